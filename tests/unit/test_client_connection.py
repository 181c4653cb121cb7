"""The main port's connection protocol without a socket: a fake transport, a handler the test
drives, a loop whose clock the test moves (the header deadline, the keep-alive wait)."""

from __future__ import annotations

import asyncio
import gc

import pytest
from support.fake_io import ClockLoop, connected, run, turns

from proxy.exchange.errors import Cause, Interrupted
from proxy.server.connections import LINGERING_SECONDS, ClientConnection, ConnectionRules, State

RULES = ConnectionRules(header_timeout=60.0, max_header_size=8192, max_connections=2, keepalive_timeout=75.0)
GET = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"


def test_pipelined_requests_are_answered_one_at_a_time_in_order() -> None:
    async def test(loop: ClockLoop) -> None:
        handler, connection, transport, _ = connected(RULES)
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
        handler, connection, _, port = connected(RULES)
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
        handler, connection, transport, _ = connected(RULES)
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
        handler, connection, transport, _ = connected(RULES)
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
        rules = ConnectionRules(header_timeout=60.0, max_header_size=8192, max_connections=0, keepalive_timeout=75.0)
        _handler, _, transport, _ = connected(rules)
        assert transport.data.startswith(b"HTTP/1.1 503 ")
        assert transport.closing

    run(test)


def test_writing_pauses_and_drains_through_the_flow_hooks() -> None:
    async def test(loop: ClockLoop) -> None:
        _handler, connection, _, _ = connected(RULES)
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


# ---- the connection's states, one test per move ----------------------------------------------------

POST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n"


def test_a_keepalive_connection_moves_open_idle_and_open_again_at_the_next_first_byte() -> None:
    async def test(loop: ClockLoop) -> None:
        rules = ConnectionRules(header_timeout=100.0, max_header_size=8192, max_connections=2, keepalive_timeout=75.0)
        handler, connection, transport, _ = connected(rules)
        assert connection.state is State.OPEN
        connection.data_received(GET)
        await turns()
        assert connection.state is State.OPEN
        handler.answer(0)
        await turns()
        assert connection.state is State.IDLE
        connection.data_received(GET[:5])
        assert connection.state is State.OPEN
        loop.now += 80.0  # (past the keep-alive deadline, which the first byte disarmed)
        await turns()
        assert connection.state is State.OPEN
        assert not transport.closing
        loop.now += 21.0
        await turns()
        assert connection.state is State.CLOSING  # the header deadline, from the first byte: a 408
        assert b"HTTP/1.1 408 " in transport.data

    run(test)


def test_a_held_pipelined_head_ends_the_keepalive_wait() -> None:
    async def test(loop: ClockLoop) -> None:
        handler, connection, transport, _ = connected(RULES)
        connection.data_received(GET + GET + GET)  # (one waits parsed, the third is held unparsed)
        await turns()
        handler.answer(0)
        await turns()
        assert len(handler.requests) == 2
        assert connection.state is State.OPEN
        loop.now += 80.0  # (past the keep-alive deadline: it was disarmed by the held head)
        await turns()
        assert not transport.closing
        handler.answer(1)
        await turns()
        handler.answer(2)
        await turns()
        assert connection.state is State.IDLE

    run(test)


def test_an_upgrade_is_answered_then_closed() -> None:
    async def test(loop: ClockLoop) -> None:
        handler, connection, transport, _ = connected(RULES)
        connection.data_received(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n")
        await turns()
        assert connection.state is State.CLOSING
        assert not transport.closing
        handler.answer(0)
        await turns()
        assert transport.data.startswith(b"HTTP/1.1 200 OK")
        assert transport.closing

    run(test)


def test_garbage_behind_a_request_is_answered_then_closed() -> None:
    async def test(loop: ClockLoop) -> None:
        handler, connection, transport, _ = connected(RULES)
        connection.data_received(GET + b"\x00\x01 not http\r\n\r\n")
        await turns()
        assert connection.state is State.CLOSING
        handler.answer(0)
        await turns()
        assert transport.data.count(b"HTTP/1.1 ") == 1
        assert transport.closing

    run(test)


def test_an_answer_before_the_body_lingers_until_the_body_ends_then_closes() -> None:
    async def test(loop: ClockLoop) -> None:
        handler, connection, transport, _ = connected(RULES)
        connection.data_received(POST + b"01234")
        await turns()
        handler.answer(0)
        await turns()
        assert connection.state is State.LINGERING
        assert not transport.closing
        connection.data_received(b"567")
        assert connection.state is State.LINGERING
        connection.data_received(b"89" + GET)  # (what follows is not parsed as a request)
        assert connection.state is State.CLOSING
        assert transport.closing
        assert len(handler.requests) == 1

    run(test)


def test_a_lingering_close_ends_at_its_deadline() -> None:
    async def test(loop: ClockLoop) -> None:
        handler, connection, transport, _ = connected(RULES)
        connection.data_received(POST + b"01234")
        await turns()
        handler.answer(0)
        await turns()
        loop.now += LINGERING_SECONDS - 0.5
        await turns()
        assert connection.state is State.LINGERING
        loop.now += 1.0
        await turns()
        assert connection.state is State.CLOSING
        assert transport.closing

    run(test)


def test_a_refused_head_while_idle_is_closing() -> None:
    async def test(loop: ClockLoop) -> None:
        handler, connection, transport, _ = connected(RULES)
        connection.data_received(GET)
        await turns()
        handler.answer(0)
        await turns()
        assert connection.state is State.IDLE
        connection.data_received(b"TRACE / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert connection.state is State.CLOSING
        assert b"HTTP/1.1 405 " in transport.data
        assert transport.closing

    run(test)


def test_the_loss_is_final_a_late_close_changes_nothing() -> None:
    async def test(loop: ClockLoop) -> None:
        handler, connection, _, _ = connected(RULES)
        connection.data_received(GET)
        await turns()
        connection.connection_lost(None)
        assert connection.state is State.CLOSED
        connection.close_now()  # (the exchange, hearing the departure, closes too)
        assert connection.state is State.CLOSED
        with pytest.raises(ConnectionResetError):
            await connection.drain()
        handler.answer(0)
        await turns()

    run(test)


def _alive(cls: type) -> int:
    """How many objects of exactly `cls` exist (the GC's list; a compiled class takes no weak reference)."""
    return sum(1 for obj in gc.get_objects() if type(obj) is cls)


def test_a_lost_connection_is_freed_by_refcounting_not_left_to_the_cyclic_gc() -> None:
    """Nothing of a closed connection (its parser, buffers, queue) waits for a collection: with
    hundreds of connections a round, what the GC would free late is what the RSS shows."""

    async def test(loop: ClockLoop) -> None:
        handler, connection, _, _ = connected(RULES)
        connection.data_received(GET)
        await turns()
        handler.answer(0)
        await turns()
        handler.requests.clear()
        gc.disable()
        try:
            before = _alive(ClientConnection)
            connection.connection_lost(None)
            del connection
            assert _alive(ClientConnection) == before - 1  # freed at once, with the collector off
        finally:
            gc.enable()

    run(test)


def test_a_departure_reaches_a_body_read_as_the_exchanges_event_not_a_reset() -> None:
    """One road for a departure: the exchange hears it (its Interrupter sets `Interrupted` on the body
    it reads), and the connection's own reset does not overtake it."""

    async def test(loop: ClockLoop) -> None:
        handler, connection, _, _ = connected(RULES)
        connection.data_received(POST + b"abc")  # 3 of the 10 bytes of its body
        await turns()
        (request,) = handler.requests
        request.on_departure(lambda: request.content.set_exception(Interrupted(Cause.CLIENT_GONE)))
        connection.connection_lost(None)
        await asyncio.wait_for(request.content.wait(), 5)
        with pytest.raises(Interrupted):
            request.content.take()
        handler.answer(0)
        await turns()

    run(test)
