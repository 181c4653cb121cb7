"""The main port's client connections, held to nginx's per-connection rules.

aiohttp's server has no header-read timeout, no bound on the total size of a request's headers and
no connection limit, and it answers requests its parser rejects with a plain-text 400 and a
traceback on stderr. This layer adds what nginx does by default:

- `--client-header-timeout`: the request line and headers must arrive within it (from the accept,
  or from the first byte of a keep-alive connection's next request); else 408 and close.
  An idle keep-alive connection is closed after `--client-keepalive-timeout` (aiohttp's own timer,
  which a head that has begun holds off: a partial head always ends in its 408).
- `--max-header-size`: the request line plus headers, in total; beyond it 431 and close.
- `--max-client-connections`: beyond it a new connection gets a 503 and is closed.
- a request the HTTP parser rejects gets a JSON 400 and is logged and counted (`bad_request`); a
  request line nginx refuses though it parses (TRACE: 405, a version other than HTTP/1.x: 505) too.

Each refusal is written straight to the socket (no request is in progress on it, so no response
can be interleaved), counted and logged by the books like any other exchange.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong

from proxy.core.dialects import DIALECTS
from proxy.core.http_head import HeadScanner, HeadTooLarge, request_line_refusal
from proxy.exchange.forward import handle
from proxy.exchange.state import ProxyState
from proxy.observe.books import Books

__all__ = ["ClientConnection", "ConnectionRules", "ProxyServer", "make_handler"]

_OTHER = DIALECTS["other"]
_PHRASES = {400: "Bad Request", 405: "Method Not Allowed", 408: "Request Timeout",
            431: "Request Header Fields Too Large", 503: "Service Unavailable", 505: "HTTP Version Not Supported"}


@dataclass(frozen=True, slots=True)
class ConnectionRules:
    header_timeout: float
    max_header_size: int
    max_connections: int


class ProxyServer(web.Server):
    """aiohttp's low-level server, making `ClientConnection`s and counting them."""

    def __init__(
        self,
        handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
        *,
        rules: ConnectionRules,
        books: Books,
        **kwargs: Any,
    ) -> None:
        super().__init__(handler, **kwargs)
        self.rules = rules
        self.books = books
        self.open_connections = 0
        self._handler_kwargs = kwargs

    def __call__(self) -> ClientConnection:
        kwargs = {k: v for k, v in self._handler_kwargs.items() if k != "handler_cancellation"}
        return ClientConnection(self, loop=asyncio.get_running_loop(), **kwargs)


class ClientConnection(web.RequestHandler):
    """One client connection: the header deadline and size bound of the request it is reading."""

    def __init__(self, manager: ProxyServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._server = manager
        self._head: HeadScanner | None = HeadScanner(manager.rules.max_header_size)
        self._head_timer: asyncio.TimerHandle | None = None
        self._counted = False
        self.flow_hooks: tuple[Callable[[], None], Callable[[], None]] | None = None  # a stream relay's

    # ---- flow control, for a stream relay that writes straight to the transport ---------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.flow_hooks is not None:
            self.flow_hooks[0]()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.flow_hooks is not None:
            self.flow_hooks[1]()

    # ---- the transport's callbacks ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        server = self._server
        super().connection_made(transport)
        if server.open_connections >= server.rules.max_connections:
            self._refuse(503, "proxy_overloaded", "the proxy has too many open connections; retry later")
            return
        server.open_connections += 1
        self._counted = True
        self._arm_head_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._counted:
            self._counted = False
            self._server.open_connections -= 1
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        head = self._head
        if head is not None and data:
            if self._head_timer is None:
                self._arm_head_timer()  # the first byte of a keep-alive connection's next request
            try:
                complete = head.feed(data)
            except HeadTooLarge:
                limit = self._server.rules.max_header_size
                self._refuse(431, "bad_request", f"the request line and headers exceed {limit} bytes")
                return
            if head.request_line is not None and (refusal := request_line_refusal(head.request_line)):
                status, message = refusal  # a method or version nginx refuses: no request is made of it
                self._refuse(status, "bad_request", message)
                return
            if complete:
                self._head = None
                self._disarm_head_timer()
        super().data_received(data)

    def _process_keepalive(self) -> None:
        """aiohttp's keep-alive timer, held off while a request head is arriving.

        Once a byte of a request has come, only --client-header-timeout applies (nginx's
        keepalive_timeout also covers an idle connection only): that head ends in its 408, never in
        a silent close because the keep-alive timeout happened to be the shorter one. aiohttp arms
        the timer again after the next response.
        """
        head = self._head
        if head is not None and head.size > 0:
            self._keepalive_handle = None
            return
        super()._process_keepalive()

    # ---- called by the proxy's handler --------------------------------------------------------

    def request_done(self) -> None:
        """The handler finished: the next bytes on this connection are a new request's head."""
        self._head = HeadScanner(self._server.rules.max_header_size)

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        """A request aiohttp's parser rejected (bad framing, NUL, obs-fold, an over-long line)."""
        if isinstance(exc, LineTooLong):
            status = 431
        reason = "bad_request" if status < 500 else "proxy_error"
        text = "the request is not valid HTTP/1.1" if status == 400 else _PHRASES.get(status, "request rejected")
        if status == 431:
            text = f"a request line or header exceeds {self._server.rules.max_header_size} bytes"
        body = _OTHER.error_body(status, text, reason)
        self._server.books.record_refusal(status, reason, len(body), client=_peer(self))
        response = web.Response(status=status, body=body, content_type="application/json")
        response.force_close()  # the connection closes once this is written
        return response

    # ---- internals ------------------------------------------------------------------------------

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        loop = asyncio.get_running_loop()
        self._head_timer = loop.call_later(self._server.rules.header_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        head = self._head
        if head is None:
            return
        if head.size == 0:
            self.force_close()  # nothing was asked: close quietly, as nginx does
            return
        timeout = self._server.rules.header_timeout
        self._refuse(408, "client_timeout", f"the request headers did not arrive within {timeout:g} s")

    def _refuse(self, status: int, reason: str, message: str) -> None:
        """Answer without a request (none is in progress on this socket), count it, close."""
        self._head = None
        self._disarm_head_timer()
        body = _OTHER.error_body(status, message, reason)
        transport = self.transport
        if transport is not None and not transport.is_closing():
            head = (
                f"HTTP/1.1 {status} {_PHRASES[status]}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n"
            )
            if status == 503:
                head += "Retry-After: 1\r\n"
            transport.write(head.encode() + b"\r\n" + body)
        self._server.books.record_refusal(status, reason, len(body), client=_peer(self))
        self.force_close()


def _peer(connection: web.RequestHandler) -> str | None:
    transport = connection.transport
    peer = transport.get_extra_info("peername") if transport is not None else None
    return str(peer[0]) if isinstance(peer, tuple) and peer else None


def make_handler(state: ProxyState) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
    """The main port's one handler (every method and path), bound to the proxy's state."""

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        try:
            return await handle(request, state)
        finally:
            # The next bytes are a new request's head only once this body was read to its end (an
            # unread one is refused with Connection: close, and aiohttp discards the rest of it).
            if isinstance(request.protocol, ClientConnection) and request.content.is_eof():
                request.protocol.request_done()

    return handler
