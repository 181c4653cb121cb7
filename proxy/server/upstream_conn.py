"""One upstream HTTP/1.1 connection on an asyncio protocol, its responses parsed by llhttp (httptools).

The protocol's callbacks do the work: the response head resolves the exchange's one wait, and each
body piece goes straight to the exchange's `BodySink` (for a stream, the relay that writes it to the
client), so no task wakes per piece. Flow control is the transport's own: the sink pauses reading
while its client cannot take more.

What it refuses, so that the pool never hands one client's bytes to another: a byte arriving while
no request waits (the connection is closed at once), a second response behind the first in one read
(closed after the first), an unrequested `101`, more interim (1xx) responses or a larger head than
any backend sends (`bad_upstream_response`), and whatever llhttp rejects (bad framing, CL with TE).
A response to HEAD, or one framed by the close, is never reused. A chunked body's trailers are
dropped (nginx does not pass them either): a trailer `Set-Cookie` or `Location` never becomes a
header, and a `Transfer-Encoding` is chunked only when `chunked` is its final coding (RFC 9112 6.3).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from enum import IntEnum
from typing import Final, cast

import httptools
from multidict import CIMultiDict

from proxy.core.headers import is_chunked
from proxy.core.lifecycle import Reason
from proxy.exchange.errors import UpstreamFailure, first_byte_timeout
from proxy.exchange.upstream import BodySink, HeadReceiver, UpstreamHead

__all__ = ["MAX_HEAD_BYTES", "MAX_INTERIM", "Response", "UpstreamConnection", "encode_request"]

MAX_HEAD_BYTES: Final = 64 * 1024  # a response's status line and headers, in total (nginx: 4-8 KiB)
MAX_INTERIM: Final = 8  # 1xx responses before the real one; a flood of `100 Continue` is not an answer

_BAD_RESPONSE = "the upstream sent an invalid HTTP response"
_CLOSED_EARLY = "the upstream closed the connection before answering"
_CUT = "the upstream connection broke before the response was complete"


class Response(IntEnum):
    """Where the connection's one response stands; every move is in `_NEXT`.

    IDLE: no request asked (a new connection); a byte now is nobody's. WAITING: a request is sent,
    its head awaited. INTERIM: a 1xx head came; its empty message ends next, then WAITING again.
    BODY: the head is out to the exchange, the body arrives. DONE: the response is whole (the pool may
    reuse the connection). FAILED: the response broke; the connection is closed, never reused.
    """

    IDLE = 0
    WAITING = 1
    INTERIM = 2
    BODY = 3
    DONE = 4
    FAILED = 5


# The states as plain names, once, beside their enum, and spelt so everywhere below (the methods run
# per header and per body piece: a global is one lookup where `Response.BODY` is two).
IDLE: Final = Response.IDLE
WAITING: Final = Response.WAITING
INTERIM: Final = Response.INTERIM
BODY: Final = Response.BODY
DONE: Final = Response.DONE
FAILED: Final = Response.FAILED

_NEXT: Final[dict[Response, frozenset[Response]]] = {
    IDLE: frozenset({WAITING}),
    WAITING: frozenset({INTERIM, BODY, FAILED}),
    INTERIM: frozenset({WAITING, FAILED}),
    BODY: frozenset({DONE, FAILED}),
    DONE: frozenset({WAITING}),
    FAILED: frozenset(),
}
_ANSWERED: Final = frozenset({IDLE, DONE, FAILED})  # no byte is awaited


class _Stray(Exception):
    """A second response began behind the first: nobody asked for it."""


def encode_request(
    method: str, target: str, host: str, headers: CIMultiDict[str], body: bytes | bytearray | None
) -> bytes:
    """The request head, `Host` first and `Content-Length` when there is a body."""
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n"]
    lines += [f"{name}: {value}\r\n" for name, value in headers.items()]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("utf-8", "surrogateescape")


class UpstreamConnection(asyncio.Protocol):
    __slots__ = ("_failure", "_feeding", "_head_by", "_head_due", "_head_only", "_head_size", "_head_timer",
                 "_head_within", "_headers", "_interim", "_on_lost", "_parser", "_pending", "_reason", "_receiver",
                 "_sink", "_told", "_until_eof", "_waiter", "closed", "idle_timer", "loop", "response", "reusable",
                 "transport")  # fmt: skip

    def __init__(self, on_lost: Callable[[UpstreamConnection], None]) -> None:
        self._on_lost = on_lost
        self.loop = asyncio.get_running_loop()
        # (None once the transport is lost: the parser holds this protocol's bound methods, a cycle
        # that would leave the connection to the cyclic GC instead of refcounting)
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self.response = IDLE
        self._waiter: asyncio.Future[UpstreamHead] | None = None
        # Or, instead of the future, the exchange that hears the head from this protocol's callbacks
        # (after llhttp's feed: `_head_due` holds it meanwhile).
        self._receiver: HeadReceiver | None = None
        self._head_due: UpstreamHead | None = None
        # A receiver's first-byte deadline (loop time) and its one timer, which outlives the requests
        # (moved on when it comes early, as the pool's idle timer), rather than a timer made per request.
        self._head_by = 0.0
        self._head_within = 0.0
        self._head_timer: asyncio.TimerHandle | None = None
        self._sink: BodySink | None = None
        self._pending: list[bytes] = []  # body pieces not yet given to the sink (one batch per read)
        # Not states of the response, but bookkeeping beside it: whether the attached sink heard the
        # end or failure (a drain taking over hears it again), and whether llhttp is calling back
        # (the sink hears of it after the read, in one batch).
        self._told = False
        self._feeding = False
        self._failure: UpstreamFailure | None = None
        self._headers: CIMultiDict[str] = CIMultiDict()
        self._reason = b""
        self._head_size = 0
        self._interim = 0
        # Facts of the response's framing, read at its end: asked with HEAD, or framed by the close.
        self._head_only = False
        self._until_eof = False
        self.transport: asyncio.Transport | None = None
        # The transport's life is apart from the response's: a response that was whole stays DONE after
        # the close (a sink that attaches late still hears its end).
        self.closed = False
        self.reusable = False
        self.idle_timer: asyncio.TimerHandle | None = None  # the pool's, while it sits idle

    # ---- what the pool and the exchange call ------------------------------------------------------

    def send(
        self, request: bytes, body: bytes | bytearray | None, *, head_only: bool,
        receiver: HeadReceiver | None = None, within: float = 0.0,
    ) -> asyncio.Future[UpstreamHead] | None:
        """Write one request; the future resolves with the response head (or an `UpstreamFailure`), or
        with a `receiver`, no future: the receiver hears the head or the failure from the callbacks,
        a first-byte timeout too when no head came `within` seconds."""
        assert self.transport is not None
        self._to(WAITING)
        self._sink, self._pending, self._failure, self._told = None, [], None, False
        self._headers, self._reason, self._head_size, self._interim = CIMultiDict(), b"", 0, 0
        self._head_only, self._until_eof, self.reusable = head_only, False, False
        self._receiver = receiver
        waiter = self._waiter = self.loop.create_future() if receiver is None else None
        if receiver is not None and within > 0:
            self._head_within = within
            due = self._head_by = self.loop.time() + within
            timer = self._head_timer
            if timer is not None and timer.when() > due:
                timer.cancel()
                timer = None
            if timer is None:
                self._head_timer = self.loop.call_at(due, self._head_late)
        if body:
            self.transport.writelines((request, body))
        else:
            self.transport.write(request)
        return waiter

    def attach(self, sink: BodySink) -> None:
        self._sink = sink
        self._told = False  # (a drain taking over from a relay hears the end again, if it came)
        self._deliver()

    def detach(self) -> None:
        """The exchange is done with it: the connection keeps nothing of it (no relay, guard or record
        lives on while it sits in the pool), nor of the response's head (the next `send` starts a new one)."""
        self._sink = None
        self._pending = []
        self._waiter = None
        self._receiver, self._head_due = None, None
        self._headers, self._reason = CIMultiDict(), b""

    @property
    def complete(self) -> bool:
        return self.response is DONE and not self.closed

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None and not self.closed:
            self.transport.close()

    # ---- the transport's callbacks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)

    def data_received(self, data: bytes) -> None:
        if self.response in _ANSWERED:
            self.close()  # bytes no request asked for: no client may ever read them
            return
        parser = self._parser
        if parser is None:
            return
        self._feeding = True
        try:
            parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            if self.response is DONE:  # (_Stray) the response is whole; the connection is not reusable
                self.close()
                return
            self._fail(Reason.BAD_UPSTREAM_RESPONSE, _BAD_RESPONSE)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            self._fail(Reason.BAD_UPSTREAM_RESPONSE, _BAD_RESPONSE)  # (a stream's relay calls it a cut)
        finally:
            self._feeding = False
            due = self._head_due
            if due is not None:  # (a receiver's head, out of llhttp's callback: its attach delivers the body)
                self._head_due = None
                receiver, self._receiver = self._receiver, None
                if receiver is not None:
                    receiver.on_head(due)
            self._deliver()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self.response in (WAITING, INTERIM):
            self._fail(Reason.CONNECT_FAILED, _CLOSED_EARLY)
        elif self.response is BODY:
            if self._until_eof and exc is None:
                self._complete()  # a body framed by the close ends with it
            else:
                self._fail(Reason.STREAM_CUT, _CUT)
        self._parser = None
        self._on_lost(self)

    # ---- llhttp's callbacks -----------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.response is DONE:
            raise _Stray

    def on_status(self, status: bytes) -> None:
        self._reason += status
        self._grow(len(status))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._grow(len(name) + len(value) + 4)  # (trailers too: a flood of them is bounded with the head)
        if self.response is not WAITING:
            return  # a chunked body's trailer: dropped, as nginx does (never a response header)
        self._headers.add(name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None  # (a callback of its own feed)
        status = parser.get_status_code()
        if 100 <= status < 200:
            self._interim += 1
            if status == 101 or self._interim > MAX_INTERIM:
                raise ValueError("an unrequested upgrade, or an interim flood")
            self._to(INTERIM)  # its (empty) message completes next; the real head follows
            self._headers, self._reason, self._head_size = CIMultiDict(), b"", 0
            return
        headers = self._headers
        length = headers.get("Content-Length")
        content_length = int(length) if length is not None and length.isdigit() else None
        chunked = is_chunked(headers.getall("Transfer-Encoding", ()))
        no_body = self._head_only or status in (204, 304)
        self._until_eof = not no_body and content_length is None and not chunked
        self._to(BODY)
        head = UpstreamHead(status, self._reason.decode("latin-1"), headers, content_length)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(head)
        elif self._receiver is not None:
            self._head_due = head  # (told after the feed, not from inside llhttp)
        if self._head_only:  # llhttp would wait for the announced body: the response ends here
            self._complete()
            self.reusable = False

    def on_body(self, body: bytes) -> None:
        if self.response is BODY:
            self._pending.append(body)

    def on_message_complete(self) -> None:
        if self.response is INTERIM:
            self._to(WAITING)
            return
        if self.response is BODY:
            assert self._parser is not None  # (a callback of its own feed)
            self.reusable = self._parser.should_keep_alive() and not self._until_eof
            self._complete()

    # ---- internals --------------------------------------------------------------------------------

    def _grow(self, size: int) -> None:
        self._head_size += size
        if self._head_size > MAX_HEAD_BYTES:
            raise ValueError("the response head is too large")

    def _to(self, response: Response) -> None:
        assert response in _NEXT[self.response], f"{self.response.name} -> {response.name}"
        self.response = response

    def _complete(self) -> None:
        self._to(DONE)
        if not self._feeding:
            self._deliver()

    def _deliver(self) -> None:
        """Give the sink what came, in one piece, then the end or the failure (once)."""
        sink = self._sink
        if sink is None:
            return
        pending = self._pending
        if pending:
            data = pending[0] if len(pending) == 1 else b"".join(pending)
            pending.clear()  # (the same list for the next read: one list per response, not per read)
            sink.body(data)
        if self._told:
            return
        response = self.response
        if response is BODY:
            return  # (the common case: more body to come)
        if response is FAILED and self._failure is not None:
            self._told = True
            sink.failed(self._failure)
        elif response is DONE:
            self._told = True
            sink.end()

    def _head_late(self) -> None:
        """The first-byte timer: a receiver still waiting past its deadline hears the timeout (and
        closes the link); one that came early is moved on to the deadline now in force."""
        self._head_timer = None
        if self._receiver is None or self.response not in (WAITING, INTERIM):
            return  # answered (the next request sets the timer again)
        if self.loop.time() < self._head_by:
            self._head_timer = self.loop.call_at(self._head_by, self._head_late)
            return
        receiver, self._receiver = self._receiver, None
        receiver.on_failure(first_byte_timeout(self._head_within))

    def _fail(self, reason: Reason, message: str) -> None:
        """The connection is unusable; whoever waits on it learns why (once), and it closes. (A whole
        response stays whole: llhttp's complaint about what follows it is the close's business.)"""
        state = self.response
        self.close()
        if state in _ANSWERED:
            return
        self._to(FAILED)
        failure = self._failure = UpstreamFailure(reason, message)
        if state is BODY:
            self._pending = []  # (a partial piece of a broken body is never passed on)
            if not self._feeding:
                self._deliver()
        elif self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(failure)
        elif self._receiver is not None:
            receiver, self._receiver = self._receiver, None
            receiver.on_failure(failure)
