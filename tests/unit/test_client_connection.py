"""The main port's connection protocol without a socket: a fake transport, a handler the test
drives, a loop whose clock the test moves (the header deadline, the keep-alive wait)."""

from __future__ import annotations

import asyncio
from typing import Any

from support.fake_io import ClockLoop, FakeTransport, run, turns

from proxy.exchange.client import ClientRequest
from proxy.server.connections import ClientConnection, ConnectionRules, MainPort

RULES = ConnectionRules(header_timeout=60.0, max_header_size=8192, max_connections=2, keepalive_timeout=75.0)
GET = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"


class Books:
    """What a refusal books: the records, nothing else."""

    def __init__(self) -> None:
        self.finished: list[Any] = []

    def start(self, ex: Any, headers: Any = None) -> None:
        pass

    def finish(self, ex: Any) -> None:
        self.finished.append(ex)


class Handler:
    """An exchange the test answers: each request waits until `answer()`."""

    def __init__(self) -> None:
        self.requests: list[ClientRequest] = []
        self.gates: list[asyncio.Event] = []
        self.cancelled = 0

    async def __call__(self, request: ClientRequest) -> None:
        self.requests.append(request)
        gate = asyncio.Event()
        self.gates.append(gate)
        try:
            await gate.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        transport = request.channel.transport
        assert transport is not None
        transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    def answer(self, i: int) -> None:
        self.gates[i].set()


def connect(handler: Handler, rules: ConnectionRules = RULES) -> tuple[ClientConnection, FakeTransport, MainPort]:
    port = MainPort(handler, rules=rules, books=Books())  # type: ignore[arg-type]
    connection = port()
    transport = FakeTransport()
    connection.connection_made(transport)
    return connection, transport, port


def test_pipelined_requests_are_answered_one_at_a_time_in_order() -> None:
    async def test(loop: ClockLoop) -> None:
        handler = Handler()
        connection, transport, _ = connect(handler)
        connection.data_received(GET + GET.replace(b"models", b"second"))
        await turns()
        assert [r.path for r in handler.requests] == ["/v1/models"]  # the second waits, parsed
        assert not transport.reading  # reading pauses while a pipelined request waits
        handler.answer(0)
        await turns()
        assert [r.path for r in handler.requests] == ["/v1/models", "/v1/second"]
        assert transport.reading
        handler.answer(1)
        await turns()
        assert transport.data.count(b"HTTP/1.1 200 OK") == 2

    run(test)


def test_a_departure_is_told_to_the_exchange_not_a_cancel_of_its_task() -> None:
    async def test(loop: ClockLoop) -> None:
        handler = Handler()
        connection, _, port = connect(handler)
        connection.data_received(GET)
        await turns()
        (request,) = handler.requests
        heard: list[bool] = []
        request.on_departure(lambda: heard.append(True))
        connection.connection_lost(None)
        assert heard == [True]
        assert request.departed
        await turns()
        assert handler.cancelled == 0
        assert port.open_connections == 0
        handler.answer(0)  # (the fake handler's write goes to a transport the connection let go)
        await turns()

    run(test)


def test_a_head_that_does_not_arrive_in_time_is_a_408_and_the_close() -> None:
    async def test(loop: ClockLoop) -> None:
        handler = Handler()
        connection, transport, _ = connect(handler)
        connection.data_received(b"GET /v1/models HTTP/1.1\r\nHo")
        loop.now += 59.0
        await turns()
        assert transport.data == b""
        loop.now += 2.0
        await turns()
        assert transport.data.startswith(b"HTTP/1.1 408 ")
        assert transport.closing
        assert handler.requests == []

    run(test)


def test_an_idle_keepalive_connection_closes_quietly_after_its_timeout() -> None:
    async def test(loop: ClockLoop) -> None:
        handler = Handler()
        connection, transport, _ = connect(handler)
        connection.data_received(GET)
        await turns()
        handler.answer(0)
        await turns()
        written = transport.data
        loop.now += 74.0
        await turns()
        assert not transport.closing
        loop.now += 2.0
        await turns()
        assert transport.closing
        assert transport.data == written  # nothing more: closed quietly, as nginx does

    run(test)


def test_a_connection_past_the_limit_gets_a_503() -> None:
    async def test(loop: ClockLoop) -> None:
        handler = Handler()
        rules = ConnectionRules(header_timeout=60.0, max_header_size=8192, max_connections=0, keepalive_timeout=75.0)
        _, transport, _ = connect(handler, rules)
        assert transport.data.startswith(b"HTTP/1.1 503 ")
        assert transport.closing

    run(test)


def test_writing_pauses_and_drains_through_the_flow_hooks() -> None:
    async def test(loop: ClockLoop) -> None:
        handler = Handler()
        connection, _, _ = connect(handler)
        events: list[str] = []
        connection.flow_hooks = (lambda: events.append("paused"), lambda: events.append("drained"))
        connection.pause_writing()
        waiter = asyncio.ensure_future(connection.drain())
        await turns()
        assert not waiter.done()
        connection.resume_writing()
        await turns()
        assert waiter.done()
        assert events == ["paused", "drained"]

    run(test)
