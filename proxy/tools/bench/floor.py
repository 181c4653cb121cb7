"""The floor: the cheapest correct HTTP/1.1 relay on the proxy's own stack, a target of `streamwarden bench`.

What a Python reverse proxy cannot go below: asyncio protocols on uvloop (as the proxy runs), httptools
parsing the client's requests and the upstream's answers only for their framing, a keep-alive pool of
upstream connections, and the answer's bytes written to the client as they come, unchanged (chunked or
Content-Length: the upstream's framing is the client's). No task per request, no judging, no books, no
log line. A request's head is rebuilt without its hop-by-hop headers (as nginx's `proxy_set_header
Connection ""` does), its body relayed as it comes (a chunked one framed again). Flow control both
ways: a full socket buffer on one side pauses reading on the other. A client that leaves closes its
upstream connection (the backend's cue to stop); an upstream that fails before answering gets the
client a 502, one that fails mid-answer cuts the client's connection. Pipelined requests are answered
in order, one at a time.

    python -m proxy.tools.bench.floor --listen 127.0.0.1:8080 --upstream 127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
from collections import deque
from typing import cast

import httptools

__all__ = ["Floor", "main", "start"]

# Hop-by-hop headers (RFC 9110 7.6.1), never forwarded; Host is rewritten to the upstream's.
_HOP = frozenset((b"connection", b"keep-alive", b"proxy-connection", b"te", b"upgrade", b"trailer", b"host",
                  b"proxy-authorization"))  # fmt: skip
_BAD_GATEWAY = b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
_BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


def _nodelay(transport: asyncio.BaseTransport) -> None:
    with contextlib.suppress(OSError, AttributeError):
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Floor:
    """The server's shared state: where the upstream is, and its idle keep-alive connections."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.host_header = f"Host: {host}:{port}\r\n".encode()
        self.idle: list[_Upstream] = []

    def close(self) -> None:
        """Close the idle upstream connections (those in use close with their clients)."""
        while self.idle:
            self.idle.pop().close()

    def acquire(self, client: _Client) -> None:
        """Give `client` a connection: an idle one now, or a new one when it is made."""
        while self.idle:
            upstream = self.idle.pop()
            if not upstream.closed:
                client.attach(upstream)
                return
        loop = asyncio.get_running_loop()
        made = loop.create_task(loop.create_connection(lambda: _Upstream(self), self.host, self.port))
        client.connecting = made
        made.add_done_callback(client.connected)


class _Upstream(asyncio.Protocol):
    """One upstream connection; its answer's bytes go to the attached client as they come."""

    def __init__(self, floor: Floor) -> None:
        self.floor = floor
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: _Client | None = None
        self.closed = False
        self.answered = False  # a byte of the answer was relayed (after it, a failure can only cut)
        self.head_only = False  # the request was HEAD: the answer ends with its head
        self.complete = False
        self.keep_alive = False  # the answer's, read at its end

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        _nodelay(transport)

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is None or client.transport is None:  # bytes nobody asked for: not reusable
            self.close()
            return
        self.answered = True
        client.transport.write(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            pass  # (a HEAD answer's end, raised from on_headers_complete)
        except httptools.HttpParserError:
            self.close()
            client.close()
            return
        if self.complete:
            self.complete = False
            reusable = self.keep_alive and not self.closed
            if self.head_only:  # the parser stopped inside the answer: a fresh one for the next
                self.parser = httptools.HttpResponseParser(self)
            client.answered(self, reusable)

    def on_headers_complete(self) -> None:
        if self.head_only:
            self.complete, self.keep_alive = True, self.parser.should_keep_alive()
            raise _HeadOnly

    def on_message_complete(self) -> None:
        if 100 <= self.parser.get_status_code() < 200:
            return  # an interim answer (100 Continue), relayed: the final one follows
        self.complete, self.keep_alive = True, self.parser.should_keep_alive()  # (llhttp forgets it after)

    def pause_writing(self) -> None:
        if self.client is not None and self.client.transport is not None:
            self.client.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.client is not None and self.client.transport is not None:
            self.client.transport.resume_reading()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        client, self.client = self.client, None
        if client is not None:
            client.upstream_lost(self)


class _HeadOnly(Exception):
    """Stops the parser at a HEAD answer's head (its Content-Length announces no body here)."""


class _Client(asyncio.Protocol):
    """One client connection: each request's head rebuilt and its body relayed to an upstream connection."""

    def __init__(self, floor: Floor) -> None:
        self.floor = floor
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.upstream: _Upstream | None = None
        self.connecting: asyncio.Task[tuple[asyncio.BaseTransport, _Upstream]] | None = None
        # Requests not yet answered, in order: each a list of the bytes to send (the first is in flight;
        # its list empties once an upstream connection takes it, and later bytes go straight there).
        self.queue: deque[tuple[list[bytes], bool]] = deque()  # (bytes, HEAD)
        self.keep_alive: deque[bool] = deque()  # per queued request, known at its end
        self.url = b""
        self.headers: list[bytes] = []
        self.chunked = False  # the request's body is chunked: its pieces are framed again on the way

    # -- the client's bytes -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        _nodelay(transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None and not self.queue:
                self.transport.write(_BAD_REQUEST)
            self.close()

    def on_message_begin(self) -> None:
        self.url, self.headers, self.chunked = b"", [], False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower not in _HOP:
            self.headers += (name, b": ", value, b"\r\n")
            if lower == b"transfer-encoding":
                self.chunked = b"chunked" in value.lower()

    def on_headers_complete(self) -> None:
        method = self.parser.get_method()
        head = b"".join((method, b" ", self.url, b" HTTP/1.1\r\n", self.floor.host_header, *self.headers, b"\r\n"))
        self.queue.append(([head], method == b"HEAD"))
        if len(self.queue) == 1:
            self.floor.acquire(self)

    def on_body(self, body: bytes) -> None:
        self._send(b"%x\r\n%s\r\n" % (len(body), body) if self.chunked else body)  # (llhttp gives the data)

    def on_message_complete(self) -> None:
        if self.chunked:
            self._send(b"0\r\n\r\n")  # (a trailer is dropped)
        self.keep_alive.append(self.parser.should_keep_alive())

    def _send(self, data: bytes) -> None:
        """The newest request's bytes: to its upstream if it is the one in flight and has one, else queued."""
        if len(self.queue) == 1 and self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.write(data)
        else:
            self.queue[-1][0].append(data)

    # -- the upstream's side ------------------------------------------------------------------------

    def connected(self, made: asyncio.Task[tuple[asyncio.BaseTransport, _Upstream]]) -> None:
        self.connecting = None
        if made.cancelled() or made.exception() is not None:
            self._bad_gateway()
            return
        upstream = made.result()[1]
        if self.transport is None or self.transport.is_closing():
            upstream.close()
            return
        self.attach(upstream)

    def attach(self, upstream: _Upstream) -> None:
        self.upstream = upstream
        upstream.client = self
        pieces, upstream.head_only = self.queue[0]
        upstream.answered = False
        assert upstream.transport is not None
        upstream.transport.writelines(pieces)
        pieces.clear()

    def answered(self, upstream: _Upstream, reusable: bool) -> None:
        """The answer in flight is whole: the connection back to the pool, the next request sent."""
        self.upstream, upstream.client = None, None
        if reusable:
            self.floor.idle.append(upstream)
        else:
            upstream.close()
        self.queue.popleft()
        keep_alive = self.keep_alive.popleft() if self.keep_alive else False
        if not keep_alive:
            self.close()
        elif self.queue:
            self.floor.acquire(self)

    def upstream_lost(self, upstream: _Upstream) -> None:
        self.upstream = None
        if upstream.answered:
            self.close()  # cut mid-answer: the client sees the cut
        else:
            self._bad_gateway()

    def _bad_gateway(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_BAD_GATEWAY)
        self.close()

    # -- flow control and the end -------------------------------------------------------------------

    def pause_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.connecting is not None:
            self.connecting.cancel()
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            upstream.client = None
            upstream.close()  # the backend's cue to stop generating


async def start(listen_host: str, listen_port: int, upstream_host: str, upstream_port: int
                ) -> tuple[asyncio.Server, int, Floor]:  # fmt: skip
    """Listen (port 0: any free port); returns the server, its port and the pool's owner."""
    floor = Floor(upstream_host, upstream_port)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(floor), listen_host, listen_port, backlog=4096,
                                      reuse_address=True)  # fmt: skip
    return server, int(server.sockets[0].getsockname()[1]), floor


async def _serve(listen: tuple[str, int], upstream: tuple[str, int]) -> None:
    server, port, _ = await start(*listen, *upstream)
    print(f"floor listening on http://{listen[0]}:{port}, relaying to http://{upstream[0]}:{upstream[1]}",
          flush=True)  # fmt: skip
    async with server:
        await server.serve_forever()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.removeprefix("http://").rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> None:
    """Serve until SIGINT/SIGTERM, on uvloop when it is installed (as the proxy does)."""
    parser = argparse.ArgumentParser(prog="python -m proxy.tools.bench.floor", description=__doc__.split("\n")[0])
    parser.add_argument("--listen", type=_address, default=("127.0.0.1", 8080), metavar="HOST:PORT")
    parser.add_argument("--upstream", type=_address, required=True, metavar="HOST:PORT")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with contextlib.suppress(KeyboardInterrupt):
        try:
            import uvloop
        except ImportError:  # pragma: no cover
            asyncio.run(_serve(args.listen, args.upstream))
        else:
            uvloop.run(_serve(args.listen, args.upstream))


if __name__ == "__main__":  # pragma: no cover
    main()
