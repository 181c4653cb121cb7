"""The main port's client connections: an asyncio protocol per connection, requests parsed by llhttp.

Each request becomes a `ClientRequest` handed to one exchange (`proxy.exchange.handler.handle`),
once llhttp's feed of the read that completed its head returns: the exchange runs in the
connections' callbacks (it calls `ClientRequest.finish` at its end) or hands back a coroutine, run
as the connection's task; its body arrives from this protocol's callbacks, and the exchange writes
its answer straight to the transport. One request is answered at a time: a pipelined one waits,
parsed, until the one before it is answered, so answers go out in order. What a connection parses
ahead is bounded: llhttp is fed one request at a time (`proxy.core.message_end` cuts the bytes at
each request's end), and once MAX_PARSED_AHEAD requests wait behind the one in progress, the rest of
the read is held unparsed and reading pauses until the queue drains (nginx, too, parses the next
request only when its turn comes). A client that leaves is an event to its exchange
(`ClientRequest.depart`), which ends it and cancels the upstream. The per-connection rules are nginx's defaults:

- `--client-header-timeout`: the request line and headers must arrive within it (from the accept,
  or from the first byte of a keep-alive connection's next request); else 408 and close. An idle
  keep-alive connection (no byte of a next request) is closed quietly after
  `--client-keepalive-timeout`.
- `--max-header-size`: the request line plus headers, in total; beyond it 431 and close.
- `--max-client-connections`: beyond it a new connection gets a 503 and is closed.
- a request llhttp rejects gets a JSON 400 and is logged and counted (`bad_request`); a head nginx
  refuses though it parses (`proxy.core.http_head.head_refusal`: TRACE 405, a version other than
  HTTP/1.x 505, no or two Hosts 400, an unknown transfer coding 501, ...) too, a pipelined one in its
  turn. A body llhttp rejects after its head (a bad chunk line) is answered 400 at once, not after
  `--client-body-timeout`.
- a response that leaves the request body unread (a 413, say) closes the connection after reading
  and discarding the rest for at most 5 s (nginx's lingering close), so the client sees the answer;
  after a body llhttp rejected, nothing more can be framed: the close follows the 400 at once.
- more than MAX_HEADERS (100) header fields in a request: 431 and close, as the size bound.

Each refusal is a lifecycle's `refused` verdict (`proxy.exchange.reply.refuse_connection`): its
status is written straight to the socket (no request is in progress on it, so no response can be
interleaved), and it is counted and logged by the books like any other exchange.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Final
from urllib.parse import unquote

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.core.http_head import MAX_HEADERS, HeadScanner, HeadTooLarge, head_refusal, request_line_refusal
from proxy.core.lifecycle import Reason
from proxy.core.message_end import MessageEnd
from proxy.exchange.client import ClientRequest
from proxy.exchange.errors import Refusal
from proxy.exchange.reply import refuse_connection
from proxy.observe.books import Books

__all__ = ["LINGERING_SECONDS", "MAX_PARSED_AHEAD", "ClientConnection", "ConnectionRules", "MainPort", "State"]

LINGERING_SECONDS = 5.0  # reading and discarding an unread request body before the close (nginx: 5 s)
MAX_PARSED_AHEAD = 1  # pipelined requests parsed and waiting behind the one in progress
_BAD_BODY = "the request body's chunked framing is not valid HTTP/1.1"
# Why reading is paused (it resumes when none is left), one bit each: a body's unread bytes past their
# high-water mark, the parse-ahead bound, or the end of parsing (a refusal, garbage, an upgrade: then
# the close).
_BODY, _PIPELINE, _STOP = 1, 2, 4
# An exchange: None when it goes on in callbacks (it calls `request.finish()` at its end), else the
# coroutine to run as the connection's task.
_Handler = Callable[[ClientRequest], Coroutine[Any, Any, object] | None]


class State(IntEnum):
    """Where a client connection stands; every move is in `_NEXT`.

    OPEN: requests are read and answered, under the header deadline while a head arrives. IDLE: the
    keep-alive wait (no byte of a next request yet), under the keep-alive deadline. CLOSING: the close
    is decided (a refusal, an upgrade, garbage behind a request, `close_now`): the request in progress is
    answered, then the close, and nothing more is parsed. LINGERING: the answer went out before the
    request body was read: the rest is read and discarded, for at most LINGERING_SECONDS, then the
    close. CLOSED: the transport is lost (final).
    """

    OPEN = 0
    IDLE = 1
    CLOSING = 2
    LINGERING = 3
    CLOSED = 4


_NEXT: Final[dict[State, frozenset[State]]] = {
    State.OPEN: frozenset({State.IDLE, State.CLOSING, State.LINGERING, State.CLOSED}),
    State.IDLE: frozenset({State.OPEN, State.CLOSING, State.CLOSED}),
    State.CLOSING: frozenset({State.LINGERING, State.CLOSED}),
    State.LINGERING: frozenset({State.CLOSING, State.CLOSED}),
    State.CLOSED: frozenset(),
}


@dataclass(frozen=True, slots=True)
class ConnectionRules:
    header_timeout: float
    max_header_size: int
    max_connections: int
    keepalive_timeout: float


class MainPort:
    """The main port's connections: the factory the listener calls, their count, and shutdown's close."""

    def __init__(self, handler: _Handler, *, rules: ConnectionRules, books: Books) -> None:
        self.handler = handler
        self.rules = rules
        self.books = books
        self.open_connections = 0
        self.connections: set[ClientConnection] = set()

    def __call__(self) -> ClientConnection:
        return ClientConnection(self)

    async def close(self, grace: float) -> None:
        """Shutdown's end: idle connections close; exchanges still running get `grace` seconds, then
        their connections are cut (their exchanges hear it as the client's departure) and their books
        are written."""
        for connection in list(self.connections):
            connection.close_if_idle()
        running = self._running()
        if running:
            await asyncio.wait(running, timeout=grace)
        for connection in list(self.connections):
            connection.abort()
        running = self._running()
        if running:
            await asyncio.wait(running, timeout=grace)
        for connection in list(self.connections):  # (what no event ended: shutdown's last resort, a cancel)
            task = connection.task
            if task is not None and not task.done():
                task.cancel()

    def _running(self) -> set[asyncio.Future[None]]:
        """The exchanges still running, each as something to wait for (its end)."""
        return {c.answered_waiter() for c in self.connections if c.running}


class ClientConnection(asyncio.Protocol):
    """One client connection (a `ClientChannel` for its exchanges)."""

    __slots__ = ("_answered_waiter", "_blocks", "_complete", "_counted", "_current", "_cutter", "_deadline_at",
                 "_drain_waiter", "_due", "_head", "_head_bytes", "_header_count", "_headers", "_held_at", "_loop",
                 "_on_deadline", "_oversize", "_parser", "_parsing", "_peer", "_port", "_queue", "_reading",
                 "_refusals", "_release_due", "_rules", "_task", "_timer", "_unparsed", "_url", "flow_hooks",
                 "peak_parsed_ahead", "state", "transport", "writing_paused")  # fmt: skip

    def __init__(self, port: MainPort) -> None:
        self._port = port
        self._rules = port.rules
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        # (None once the transport is lost, or once a request's body failed to parse: the parser holds
        # this protocol's bound methods, a cycle that would leave the connection to the cyclic GC
        # instead of refcounting)
        self._parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self._head: HeadScanner | None = HeadScanner(port.rules.max_header_size)
        self.state = State.OPEN
        # The state's deadline (header, keep-alive, lingering): when, and what it does then. Its one timer
        # outlives the deadlines (moved on when it comes early), rather than a timer made and cancelled
        # for each (two per keep-alive request).
        self._deadline_at = 0.0
        self._on_deadline: Callable[[], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._counted = False  # in the port's count: from the accept (unless refused at the limit) to the loss
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._parsing: ClientRequest | None = None  # the request whose head or body is arriving
        # Parsed, waiting for the one before to be answered (at most MAX_PARSED_AHEAD: a list, not a
        # deque, whose first block alone is ~600 bytes per connection).
        self._queue: list[ClientRequest] = []
        self._current: ClientRequest | None = None
        self._due: ClientRequest | None = None  # the current one, begun once llhttp's feed returns
        self._task: asyncio.Task[None] | None = None
        self._answered_waiter: asyncio.Future[None] | None = None  # (shutdown's: made only when it asks)
        self._complete: list[ClientRequest] = []  # requests whose body was received to its end (a few)
        self._peer: str | None = None
        # Flow control, apart from the state (a connection in any state may be paused either way):
        # writing paused by the transport; reading paused while `_blocks` holds a reason bit (`_reading`
        # mirrors the transport, `_release_due` says a resume is already scheduled).
        self.writing_paused = False
        self.flow_hooks: tuple[Callable[[], None], Callable[[], None]] | None = None  # a stream relay's
        self._drain_waiter: asyncio.Future[None] | None = None
        self._reading = True
        self._head_bytes = 0
        self._header_count = 0
        self._oversize = ""  # why the head llhttp is parsing passed a bound (its 431), or ""
        self._cutter = MessageEnd()
        self._unparsed = b""  # read but not fed to llhttp: held while reading is paused, from `_held_at`
        self._held_at = 0
        self._blocks = 0
        self._release_due = False
        self._refusals: dict[ClientRequest, tuple[int, str]] = {}  # pipelined heads refused in their turn
        self.peak_parsed_ahead = 0

    # ---- ClientChannel ------------------------------------------------------------------------------

    async def drain(self) -> None:
        if not self.writing_paused or self.state is State.CLOSED:
            if self.state is State.CLOSED:
                raise ConnectionResetError("the client closed the connection")
            return
        waiter = self._drain_waiter = self._loop.create_future()
        await waiter

    def close_now(self) -> None:
        self._to(State.CLOSING)
        if self.transport is not None:
            self.transport.close()

    def pause_reading(self) -> None:
        """A request body's reader has enough unread (its high-water mark)."""
        self._block(_BODY)

    def resume_reading(self) -> None:
        self._unblock(_BODY)

    @property
    def parsed_ahead(self) -> int:
        """Requests parsed and waiting behind the one in progress (at most MAX_PARSED_AHEAD)."""
        return len(self._queue)

    @property
    def held_bytes(self) -> int:
        """Bytes read from the socket and held unparsed (at most one read's worth)."""
        return len(self._unparsed) - self._held_at

    # ---- the transport's callbacks ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self._peer = str(peer[0]) if isinstance(peer, tuple) and peer else None
        port = self._port
        if port.open_connections >= self._rules.max_connections:
            self._refuse(Reason.PROXY_OVERLOADED, "the proxy has too many open connections; retry later")
            return
        port.open_connections += 1
        port.connections.add(self)
        self._counted = True
        self._arm(self._rules.header_timeout, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._to(State.CLOSED)
        if self._counted:
            self._counted = False
            self._port.open_connections -= 1
            self._port.connections.discard(self)
        self._drop_timer()  # (the timer holds this protocol: freed at once, not when it comes)
        if self._current is not None:
            # The client left: an event to its exchange, first (one road: a body read it is in raises
            # the exchange's `Interrupted`, and the upstream is cancelled as its answer says).
            self._current.depart()
        for request in (self._current, self._parsing, *self._queue):  # (bodies no exchange was told of)
            if request is not None and request not in self._complete:
                request.content.set_exception(ConnectionResetError("the client closed the connection"))
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("the client closed the connection"))
        self.transport = None
        self._parser = None

    def pause_writing(self) -> None:
        self.writing_paused = True
        if self.flow_hooks is not None:
            self.flow_hooks[0]()

    def resume_writing(self) -> None:
        self.writing_paused = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self.flow_hooks is not None:
            self.flow_hooks[1]()

    def data_received(self, data: bytes) -> None:
        head = self._head
        if head is not None and data and self.state is not State.LINGERING:
            if self.state is State.IDLE:
                self._to(State.OPEN)  # a next request's first byte: its head is under the header deadline
                self._disarm()
            if self._on_deadline is None:
                self._arm(self._rules.header_timeout, self._head_timed_out)
            try:
                complete = head.feed(data)
            except HeadTooLarge:
                limit = self._rules.max_header_size
                self._refuse(Reason.BAD_REQUEST, f"the request line and headers exceed {limit} bytes", 431)
                return
            if head.request_line is not None and (refusal := request_line_refusal(head.request_line)):
                status, message = refusal  # a method or version nginx refuses: no request is made of it
                self._refuse(Reason.BAD_REQUEST, message, status)
                return
            if complete:
                self._head = None
                self._disarm()
        if self._unparsed:  # (a read that came as reading paused: after what is held, in order)
            self._unparsed, self._held_at = self._unparsed[self._held_at :] + data, 0
            return
        self._feed(data)

    # ---- feeding llhttp, one request at a time ----------------------------------------------------

    def _feed(self, data: bytes, at: int = 0) -> None:
        """Feed `data[at:]`, cut at each request's end; hold the rest once reading is paused (by its
        offset: a read of many pipelined requests is never copied once per request). A request whose
        head came begins its exchange after the feed, outside llhttp's callbacks, with as much of its
        body as the read brought."""
        self._feed_pieces(data, at)
        due = self._due
        if due is not None:
            self._due = None
            self._begin(due)

    def _feed_pieces(self, data: bytes, at: int) -> None:
        view = memoryview(data)
        size = len(data)
        while at < size:
            lingering = self.state is State.LINGERING
            if self._blocks and not lingering:
                self._unparsed, self._held_at = data, at
                return
            end = size if lingering else self._cutter.cut(data, at)
            if not self._parse(view[at:end]):
                self._unparsed, self._held_at = b"", 0
                return
            at = end
        self._unparsed, self._held_at = b"", 0

    def _parse(self, piece: memoryview) -> bool:
        """One piece to llhttp; False when nothing more is to be parsed on this connection."""
        parser = self._parser
        if parser is None:
            return False
        parsed = True
        try:
            parser.feed_data(piece)
        except httptools.HttpParserUpgrade:
            self._to(State.CLOSING)  # (Upgrade is hop-by-hop: the request is answered, then the close)
            self._block(_STOP)
        except httptools.HttpParserError:
            self._parse_failed()
            parsed = False
        transport = self.transport
        return parsed and self.state is not State.CLOSED and transport is not None and not transport.is_closing()

    def _parse_failed(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return  # (the head was refused already: what llhttp makes of the rest is moot)
        if self.state is State.LINGERING:
            self.close_now()
        elif self._current is None and self._parsing is None:
            if self._oversize:
                self._refuse(Reason.BAD_REQUEST, self._oversize, 431)
            else:
                self._refuse(Reason.BAD_REQUEST, "the request is not valid HTTP/1.1")
        else:
            if self._parsing is not None:  # its body broke: its exchange answers 400 now, not at its timeout
                self._parsing.content.set_exception(Refusal(Reason.BAD_REQUEST, _BAD_BODY))
            self._to(State.CLOSING)  # garbage behind a request: it is answered, then the close
            self._block(_STOP)
            # llhttp goes no further after an error: nothing after it can be framed, so the close
            # follows the answer at once, unread bytes or not (nginx too), rather than a lingering read.
            self._parser = None

    def _block(self, why: int) -> None:
        self._blocks |= why
        if self._reading and self.transport is not None and self.state is not State.CLOSED:
            self._reading = False
            self.transport.pause_reading()

    def _unblock(self, why: int) -> None:
        self._blocks &= ~why
        if not self._blocks and not self._release_due and self.state is not State.CLOSED:
            self._release_due = True
            self._loop.call_soon(self._release)  # (not inside the reader's or the answer's call)

    def _release(self) -> None:
        """Nothing holds reading back: what was held is parsed, then the socket is read again."""
        self._release_due = False
        if self._blocks or self.state is State.CLOSED:
            return
        held, at, self._unparsed, self._held_at = self._unparsed, self._held_at, b"", 0
        if held:
            self._feed(held, at)
        if not self._blocks and not self._reading and self.transport is not None:  # (None once CLOSED)
            self._reading = True
            self.transport.resume_reading()

    # ---- llhttp's callbacks -------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._head_bytes = self._header_count = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._grow(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._grow(len(name) + len(value) + 4)
        self._header_count += 1
        if self._header_count > MAX_HEADERS:  # (Apache's, HAProxy's and Envoy's default bound)
            self._oversize = f"the request has more than {MAX_HEADERS} header fields"
            raise HeadTooLarge
        self._headers.append((name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape")))

    def _grow(self, size: int) -> None:
        """The bound on a head, also for a pipelined one the scanner does not see."""
        self._head_bytes += size
        if self._head_bytes > self._rules.max_header_size:
            self._oversize = f"the request line and headers exceed {self._rules.max_header_size} bytes"
            raise HeadTooLarge

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None  # (a callback of its own feed)
        # (the head's pieces, taken: not kept on the connection while the request runs)
        url, headers, self._url, self._headers = self._url, self._headers, b"", []
        raw = url.decode("utf-8", "surrogateescape")
        try:
            path = unquote(httptools.parse_url(url).path.decode("utf-8", "surrogateescape"))
        except httptools.HttpParserInvalidURLError:
            path = raw
        major, _, minor = parser.get_http_version().partition(".")
        method, version = parser.get_method().decode("ascii", "replace"), (int(major), int(minor or 0))
        request = ClientRequest(
            self, method, raw, path, version, CIMultiDictProxy(CIMultiDict(headers)),
            remote=self._peer, keep_alive=parser.should_keep_alive(),
        )
        self._cutter.framed(request.content_length, "Transfer-Encoding" in request.headers)
        self._head = None
        self._disarm()  # (the header deadline is met; in IDLE, a held request's head ends the keep-alive wait)
        if self.state is State.IDLE:
            self._to(State.OPEN)
        if (refusal := head_refusal(method, version, raw, headers)) is not None:
            self._refuse_head(request, refusal)
            return
        self._parsing = request
        if self._current is None:
            self._start(request, now=False)
        else:
            self._enqueue(request)

    def _refuse_head(self, request: ClientRequest, refusal: tuple[int, str]) -> None:
        """A head nginx refuses: answered now, or in its turn behind the request in progress."""
        status, message = refusal
        if self._current is None:
            self._refuse(Reason.BAD_REQUEST, message, status)
            return
        self._refusals[request] = refusal
        self._enqueue(request)
        self._block(_STOP)  # nothing behind it is parsed: the connection closes after its answer

    def _enqueue(self, request: ClientRequest) -> None:
        self._queue.append(request)
        self.peak_parsed_ahead = max(self.peak_parsed_ahead, len(self._queue))
        if len(self._queue) >= MAX_PARSED_AHEAD:
            self._block(_PIPELINE)

    def on_body(self, body: bytes) -> None:
        if self._parsing is not None and self.state is not State.LINGERING:
            self._parsing.content.feed(body)

    def on_message_complete(self) -> None:
        request = self._parsing
        self._parsing = None
        if self.state is State.LINGERING:
            self.close_now()
            return
        self._cutter.ended()
        if request is not None:
            self._complete.append(request)
            request.content.feed_eof()
        if self._current is not None or self._queue:
            self._head = None  # a pipelined request's head: measured when its turn comes
        else:
            self._head = HeadScanner(self._rules.max_header_size)

    # ---- shutdown ---------------------------------------------------------------------------------

    def close_if_idle(self) -> None:
        if self._current is None and self._parsing is None and self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The task running the current exchange, if it has one (its own, or the one it handed over to)."""
        if self._task is not None:
            return self._task
        return self._current.task if self._current is not None else None

    @property
    def running(self) -> bool:
        """An exchange is in progress on this connection."""
        return self._current is not None

    def answered_waiter(self) -> asyncio.Future[None]:
        """A future done when the current exchange is over (shutdown's wait; made only then)."""
        if self._answered_waiter is None:
            self._answered_waiter = self._loop.create_future()
            if self._current is None:
                self._answered_waiter.set_result(None)
        return self._answered_waiter

    # ---- the exchanges ----------------------------------------------------------------------------

    def _start(self, request: ClientRequest, *, now: bool = True) -> None:
        """The request's turn; its exchange begins now, or (`now` False, inside llhttp's feed) once the
        feed returns."""
        if (refusal := self._refusals.pop(request, None)) is not None:
            self._queue.clear()
            self._refuse(Reason.BAD_REQUEST, refusal[1], refusal[0])
            return
        self._current = request
        if now:
            self._begin(request)
        else:
            self._due = request

    def _begin(self, request: ClientRequest) -> None:
        """The exchange runs in callbacks (it calls `request.finish()`, maybe before this returns), or
        as this connection's task when it hands back a coroutine."""
        if self._current is not request:
            return  # (the connection was lost meanwhile)
        request.finished = self._answered
        work = self._port.handler(request)
        if work is not None:
            request.finished = None
            self._task = self._loop.create_task(self._run(request, work))

    async def _run(self, request: ClientRequest, work: Coroutine[Any, Any, object]) -> None:
        try:
            await work
        finally:
            self._answered(request)

    def _answered(self, request: ClientRequest) -> None:
        """The exchange is over: the next request's turn, the keep-alive wait, a lingering close, or the close."""
        self._current = None
        self._task = None
        self.flow_hooks = None
        request.finished = None
        waiter, self._answered_waiter = self._answered_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        whole = request in self._complete
        if whole:
            self._complete.remove(request)
        transport = self.transport
        if transport is None or self.state is State.CLOSED or transport.is_closing():
            return
        if not whole and self._parser is None:  # (the body broke: the parser failed on it)
            transport.close()
            return
        if not whole:
            self._linger()  # the answer went out before the body was read: read it out, then close
            return
        if not request.keep_alive or self.state is State.CLOSING:
            transport.close()
            return
        if self._queue:
            self._start(self._queue.pop(0))
            if len(self._queue) < MAX_PARSED_AHEAD:
                self._unblock(_PIPELINE)
            return
        self._head = HeadScanner(self._rules.max_header_size)
        self._to(State.IDLE)
        self._arm(self._rules.keepalive_timeout, self._idle_timed_out)
        self._unblock(_PIPELINE)

    def _linger(self) -> None:
        """Read and discard the rest of the request body, for at most LINGERING_SECONDS, then close."""
        assert self.transport is not None
        self._to(State.LINGERING)
        self._queue.clear()
        self._blocks = 0
        self._unblock(_PIPELINE)
        self._arm(LINGERING_SECONDS, self.close_now)

    # ---- the state, timers and refusals -----------------------------------------------------------

    def _to(self, state: State) -> None:
        """The one place the state moves. CLOSED is final: a close decided after the loss changes nothing."""
        if self.state is State.CLOSED or state is self.state:
            return
        assert state in _NEXT[self.state], f"{self.state.name} -> {state.name}"
        self.state = state

    def _arm(self, seconds: float, callback: Callable[[], None]) -> None:
        """`callback` at `seconds` from now (replacing the deadline armed before)."""
        at = self._deadline_at = self._loop.time() + seconds
        self._on_deadline = callback
        timer = self._timer
        if timer is not None:
            if timer.when() <= at:
                return  # it comes first, and moves on to `at`
            timer.cancel()
        self._timer = self._loop.call_at(at, self._deadline_passed)

    def _disarm(self) -> None:
        self._on_deadline = None  # (the timer, if any, finds nothing to do when it comes)

    def _drop_timer(self) -> None:
        self._on_deadline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _deadline_passed(self) -> None:
        self._timer = None
        callback = self._on_deadline
        if callback is None:
            return
        if self._loop.time() < self._deadline_at:  # came early: the deadline moved on since it was set
            self._timer = self._loop.call_at(self._deadline_at, self._deadline_passed)
            return
        self._on_deadline = None
        callback()

    def _idle_timed_out(self) -> None:
        if self._current is None and self._parsing is None and self.transport is not None:
            self.transport.close()  # nothing was asked: close quietly, as nginx does

    def _head_timed_out(self) -> None:
        head = self._head
        if head is None or self._current is not None:
            return
        if head.size == 0:
            if self.transport is not None:
                self.transport.close()  # nothing was asked: close quietly, as nginx does
            return
        timeout = self._rules.header_timeout
        self._refuse(Reason.CLIENT_TIMEOUT, f"the request headers did not arrive within {timeout:g} s")

    def _refuse(self, reason: Reason, message: str, status: int = 0) -> None:
        """Answer without a request (none is in progress on this socket): the lifecycle's verdict, its
        status written and booked, then the close."""
        self._to(State.CLOSING)
        self._head = None
        self._disarm()
        self._block(_STOP)
        refuse_connection(self, self._port.books, reason, message, status=status, remote=self._peer)
        transport = self.transport
        if transport is not None:
            with contextlib.suppress(RuntimeError):
                transport.close()
