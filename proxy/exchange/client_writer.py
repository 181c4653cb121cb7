"""Writing to the client: the status line once, the body framed as it must be, bytes counted, and a
client that stalls noticed.

Each response is written straight to the connection's transport: its head (status line, headers and
the framing: `Content-Length`, chunked, or the close), then its body. A stream's relay writes from
the upstream's callbacks with `write_raw` (one `transport.write` each) and hears the transport's
flow-control events through `on_flow`; the handler's writes wait for the client to drain only when
the transport is above its high-water mark, and at most --client-stall-timeout, after which the
client counts as gone (`ClientStalled`). A write to a closed connection raises `ConnectionError`.

A whole response (the proxy's own error JSON, or an upstream body read whole) is written here, to
its last byte, before the exchange is booked: a client that leaves during it is an abort, not `ok`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from email.utils import formatdate
from http import HTTPStatus

from proxy.core.lifecycle import Lifecycle
from proxy.core.record import ExchangeRecord
from proxy.exchange.client import ClientRequest
from proxy.exchange.client_gone import ClientGone

__all__ = ["ClientGone", "ClientStalled", "ClientWriter", "ResponseHead"]

_Hook = Callable[[], None]
_NO_BODY = frozenset({204, 304})
# The writer's own headers: the framing it chooses, and the exchange's X-Request-Id (set here and
# nowhere else, on every response the proxy sends: relayed, judged, its own errors and refusals).
_OWN = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "x-request-id"})
_date: tuple[int, bytes] = (0, b"")


class ClientStalled(Exception):
    """The client stopped reading for longer than --client-stall-timeout."""


class ResponseHead:
    __slots__ = ("content_length", "headers", "reason", "status")

    def __init__(
        self, status: int, headers: Mapping[str, str], *, reason: str | None = None, content_length: int | None = None
    ) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.content_length = content_length


def _http_date() -> bytes:
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, formatdate(now, usegmt=True).encode())
    return _date[1]


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


class ClientWriter:
    __slots__ = ("_body", "_chunked", "_closing", "_ended", "_held_head", "_status", "ex", "life", "request",
                 "stall_timeout")  # fmt: skip

    def __init__(self, request: ClientRequest, ex: ExchangeRecord, life: Lifecycle, stall_timeout: float) -> None:
        self.request = request
        self.ex = ex
        self._held_head = b""
        self._ended = False  # the body's end (its last chunk) went out: once only
        self.life = life
        self.stall_timeout = stall_timeout
        self._status: int | None = None  # the committed head's (its headers are not kept once written)
        self._body = False  # `_body_allowed()`, fixed with the head: `write_raw` reads it once per piece
        self._chunked = False
        self._closing = not request.keep_alive  # the connection closes after this response

    @property
    def closing(self) -> bool:
        return self._closing

    # ---- the head ---------------------------------------------------------------------------------

    def _head(self, head: ResponseHead, *, length: int | None, close: bool) -> bytes:
        """The status line and headers; the framing is this writer's to choose."""
        request = self.request
        status = head.status
        body_allowed = status not in _NO_BODY and not 100 <= status < 200
        if close:
            self._closing = True
        lines = [f"HTTP/1.1 {status} {head.reason or _phrase(status)}\r\n"]
        lines.extend(f"{name}: {value}\r\n" for name, value in head.headers.items() if name.lower() not in _OWN)
        lines.append(f"X-Request-Id: {self.ex.request_id}\r\n")
        self._chunked = False
        if not body_allowed:
            pass
        elif request.method == "HEAD":
            if length is not None:
                lines.append(f"Content-Length: {length}\r\n")  # what a GET would have had
        elif length is not None:
            lines.append(f"Content-Length: {length}\r\n")
        elif request.version >= (1, 1):
            lines.append("Transfer-Encoding: chunked\r\n")
            self._chunked = True
        else:
            self._closing = True  # HTTP/1.0 without a length: the close ends the body
        if self._closing:
            request.keep_alive = False  # what the head says is what the connection does
            lines.append("Connection: close\r\n")
        elif request.version < (1, 1):
            lines.append("Connection: keep-alive\r\n")
        raw = "".join(lines).encode("utf-8", "surrogateescape")
        if "Date" in head.headers:
            return raw + b"\r\n"
        return raw + b"Date: " + _http_date() + b"\r\n\r\n"

    def _body_allowed(self) -> bool:
        status = self._status
        return status is not None and self.request.method != "HEAD" and status not in _NO_BODY

    # ---- writing ----------------------------------------------------------------------------------

    async def commit(self, head: ResponseHead, *, close: bool = False) -> None:
        """Send the status line and headers (once), and wait for the client to take them in."""
        self.commit_now(head, close=close)
        if self.paused:
            await self.drained()

    def commit_now(self, head: ResponseHead, *, close: bool = False, hold: bool = False) -> None:
        """Hand the status line and headers to the transport (once): from here the exchange is
        committed (`Lifecycle.committed`), in the same step as the bytes go out.

        `hold`: the head waits for the first body bytes and goes out with them in one write (one
        system call, one packet) until `flush_head`; a held stream's first events come right after."""
        if self._status is not None:
            return
        self._status = self.ex.status = head.status
        self._body = self._body_allowed()
        self.life.committed_now()
        data = self._head(head, length=head.content_length, close=close)
        if hold:
            self._held_head = data
        else:
            self._send(data)

    def flush_head(self) -> None:
        """Send a held head that no body bytes came to carry (a no-op when there is none)."""
        held, self._held_head = self._held_head, b""
        transport = self.request.channel.transport
        if held and transport is not None and not transport.is_closing():
            transport.write(held)

    async def write(self, data: bytes) -> None:
        assert self._status is not None, "commit first"
        if not self.write_raw(data):
            raise ClientGone("the client closed the connection")
        if self.paused:
            await self.drained()

    def write_raw(self, data: bytes) -> bool:
        """Write `data` as the next piece of the body, framed; False when the client is gone.

        The exchange's `bytes_out` is counted here and in `whole_now`, nowhere else: the body's
        bytes handed to the client's transport (its framing not included)."""
        transport = self.request.channel.transport
        if transport is None or transport.is_closing():
            return False
        self.ex.bytes_out += len(data)
        if not self._body:
            self.flush_head()
            return True
        framed = b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data
        if self._held_head:
            framed, self._held_head = self._held_head + framed, b""
        transport.write(framed)
        return True

    def on_flow(self, paused: _Hook, drained: _Hook) -> None:
        """Call `paused()` when the client's buffer passes its high-water mark, `drained()` after."""
        channel = self.request.channel
        channel.flow_hooks = (paused, drained)
        if channel.writing_paused:
            paused()

    def release_flow(self) -> None:
        self.request.channel.flow_hooks = None

    async def finish(self) -> None:
        """The body is complete: its end goes out (the last chunk, once), and the client takes it in."""
        self.finish_now()
        if self.paused:
            await self.drained()

    def finish_now(self) -> None:
        """The body's end (the last chunk, once) handed to the transport; `drained` waits for the client."""
        if self._chunked and self._body_allowed() and not self._ended:
            self._ended = True
            self._send(b"0\r\n\r\n")

    def whole_now(
        self,
        status: int,
        body: bytes,
        headers: Mapping[str, str],
        *,
        reason: str | None = None,
        content_type: str | None = "application/json",
        close: bool = False,
    ) -> ResponseHead:
        """A whole response (nothing was committed before it), handed to the transport without waiting
        for the client to take it in (`drained` waits). The proxy's own error JSON (`reply.write_error`),
        or an upstream body read whole (`content_type=None`: its own headers say what it is). `close`:
        the connection closes after it."""
        if content_type is not None:
            headers = {k: v for k, v in headers.items() if k.lower() != "content-type"}
            headers["Content-Type"] = content_type
        head = ResponseHead(status, headers, reason=reason)
        self._status = self.ex.status = status
        self._body = self._body_allowed()
        self.life.committed_now()
        data = self._head(head, length=len(body), close=close)
        self._send(data + body if self._body_allowed() else data)
        self.ex.bytes_out = len(body)
        return head

    def close_now(self) -> None:
        """Close the connection once what was written has gone, without reading the rest of the request
        body first: for a client that stopped sending it, or at shutdown."""
        self._closing = True
        self.flush_head()
        self.request.channel.close_now()

    def cut(self) -> None:
        """Drop the client connection without another byte (no second HTTP response in the body)."""
        self._closing = True
        self.flush_head()  # a committed head went out before the cut, as it always has
        transport = self.request.channel.transport
        if transport is not None:
            transport.abort()

    # ---- internals --------------------------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        transport = self.request.channel.transport
        if transport is None or transport.is_closing():
            raise ClientGone("the client closed the connection")
        if self._held_head:
            data, self._held_head = self._held_head + data, b""
        transport.write(data)

    @property
    def paused(self) -> bool:
        """The client's transport is past its high-water mark: `drained` has something to wait for
        (a caller that checks this first makes no coroutine on the common path)."""
        return self.request.channel.writing_paused

    async def drained(self) -> None:
        """Until the client has taken in what was written (down to the transport's low-water mark)."""
        channel = self.request.channel
        if not channel.writing_paused:
            return  # nothing to wait for: no timer
        try:
            async with asyncio.timeout(self.stall_timeout):
                await channel.drain()
        except TimeoutError:
            raise ClientStalled from None
