"""Fake sockets for the protocol classes, in the manner of uvicorn's MockTransport: no loopback, no
timing; what was written is kept, pause and drain are set by hand, and a test drives every callback."""

from __future__ import annotations

import asyncio
import dataclasses
import io
from collections.abc import Callable, Coroutine
from typing import Any, NamedTuple, TypeVar

from multidict import CIMultiDict, CIMultiDictProxy
from prometheus_client import CollectorRegistry

from proxy.config import Config
from proxy.core.dialects import DIALECTS
from proxy.core.guard import StreamGuard
from proxy.core.lifecycle import Lifecycle
from proxy.core.record import ExchangeRecord
from proxy.exchange.client import ClientRequest
from proxy.exchange.client_writer import ClientWriter
from proxy.exchange.upstream import BodySink
from proxy.observe.books import Books
from proxy.observe.logs import make_logger
from proxy.observe.metrics import Metrics
from proxy.server.connections import ClientConnection, ConnectionRules, MainPort

_Hook = Callable[[], None]


class ClockLoop(asyncio.SelectorEventLoop):
    """A loop whose `time()` only moves when the test says so: timers fire on `advance`, never by waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0

    def time(self) -> float:
        return self.now


_Loop = TypeVar("_Loop", bound=ClockLoop)


def run(test: Callable[[_Loop], Coroutine[Any, Any, None]], loop_type: type[_Loop] = ClockLoop) -> None:  # type: ignore[assignment]
    """Run one test on a fresh loop of `loop_type`: each test owns its clock."""
    with asyncio.Runner(loop_factory=loop_type) as runner:
        loop = runner.get_loop()
        assert isinstance(loop, loop_type)
        runner.run(test(loop))  # (bounded by pytest-timeout: the loop's clock is the test's)


async def turns(n: int = 5) -> None:
    """Let the loop run `n` rounds of ready callbacks (what a protocol schedules with call_soon)."""
    for _ in range(n):
        await asyncio.sleep(0)


async def advance(loop: ClockLoop, seconds: float) -> None:
    """Move the clock, then let the timers that are now due fire."""
    loop.now += seconds
    await turns()


class FakeTransport(asyncio.Transport):
    """Keeps every write; `abort`/`close` only mark it closing."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.closing = False
        self.aborted = False
        self.reading = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closing, "a write after the close"
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = self.aborted = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 40000) if name == "peername" else default

    @property
    def data(self) -> bytes:
        return b"".join(self.written)


class FakeChannel:
    """A ClientChannel over a FakeTransport; the test sets `writing_paused` and calls `drained()`."""

    def __init__(self) -> None:
        self.transport: FakeTransport | None = FakeTransport()
        self.writing_paused = False
        self.flow_hooks: tuple[_Hook, _Hook] | None = None
        self.closed_now = False
        self._drain: asyncio.Future[None] | None = None

    async def drain(self) -> None:
        if self.writing_paused:
            self._drain = asyncio.get_running_loop().create_future()
            await self._drain

    def close_now(self) -> None:
        self.closed_now = True

    def pause_reading(self) -> None:
        assert self.transport is not None
        self.transport.pause_reading()

    def resume_reading(self) -> None:
        assert self.transport is not None
        self.transport.resume_reading()

    # ---- the test's side ----------------------------------------------------------------------------

    def pause_writing(self) -> None:
        self.writing_paused = True
        if self.flow_hooks is not None:
            self.flow_hooks[0]()

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        if self.flow_hooks is not None:
            self.flow_hooks[1]()


class FakeLink:
    """An UpstreamLink whose body the test delivers through `sink`."""

    def __init__(self) -> None:
        self.sink: BodySink | None = None
        self.reading = True
        self.complete = False

    def attach(self, sink: BodySink) -> None:
        self.sink = sink

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


class Exchange:
    """One streamed chat exchange's own objects (guard, lifecycle, writer) over fakes."""

    def __init__(self, *, hold: float = 5.0, api: str = "chat_completions", **flags: float) -> None:
        self.cfg = dataclasses.replace(Config(upstream="http://127.0.0.1:1"), hold_headers=hold, **flags)
        self.channel = FakeChannel()
        headers: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())
        self.request = ClientRequest(self.channel, "POST", "/v1/chat/completions", "/v1/chat/completions", (1, 1),
                                     headers, remote=None, keep_alive=True)  # fmt: skip
        self.dialect = DIALECTS[api]
        self.ex = ExchangeRecord("r1", "POST", "/v1/chat/completions", self.dialect.name, None)
        self.life = Lifecycle(self.ex)
        self.life.sent()
        self.life.headers_received(stream=True)
        self.guard = StreamGuard(self.dialect, hold=hold > 0, max_event_size=self.cfg.max_event_size)
        self.out = ClientWriter(self.request, self.ex, self.life, self.cfg.client_stall_timeout)
        self.link = FakeLink()

    @property
    def sent(self) -> bytes:
        transport = self.channel.transport
        assert transport is not None
        return transport.data

    @property
    def sink(self) -> BodySink:
        assert self.link.sink is not None, "the relay is not attached"
        return self.link.sink


def chat_chunk(text: str) -> bytes:
    return (b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"'
            + text.encode() + b'"},"finish_reason":null}]}\n\n')  # fmt: skip


# ---- a client connection on the main port ----------------------------------------------------------------


def books() -> Books:
    """What a refusal books, on a registry and a log of the test's own (the real class: a compiled
    build takes no stand-in)."""
    return Books(Metrics(registry=CollectorRegistry()), make_logger(stream=io.StringIO()))


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


class Connected(NamedTuple):
    handler: Handler
    connection: ClientConnection
    transport: FakeTransport
    port: MainPort


def connected(rules: ConnectionRules) -> Connected:
    """The arrangement of a connection test: the main port under `rules`, one connection on a fake
    transport, and a handler the test answers."""
    handler = Handler()
    port = MainPort(handler, rules=rules, books=books())
    connection = port()
    transport = FakeTransport()
    connection.connection_made(transport)
    return Connected(handler, connection, transport, port)
