"""`streamwarden bench`'s load generator: a raw-asyncio HTTP/1.1 client cheap enough not to be the limit.

aiohttp's client costs more per event than a fast proxy does, so on a 2-core machine it would measure
itself. This one keeps one connection per simulated client (keep-alive, like an SDK's pool), writes a
prepared request, and reads the response with `ResponseReader`, a sans-IO parser that only counts:
the first byte (TTFB), the first SSE event of any kind (TTFE), the first *content* event (TTFT), the
events, and the end. Times are `time.perf_counter()` at the `data_received` callback.
"""

from __future__ import annotations

import asyncio
import re
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

__all__ = ["Client", "Exchange", "ResponseReader", "build_request"]

_FIRST_CONTENT = re.compile(rb'"(?:content|text)":\s*"[^"]')
MAX_HEAD = 64 * 1024


class ProtocolError(Exception):
    """The server's response is not HTTP/1.1 this client understands."""


def build_request(host: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    for name, value in (headers or {}).items():
        head += f"{name}: {value}\r\n"
    return head.encode() + b"\r\n" + body


@dataclass
class Exchange:
    """One request's outcome, as the client saw it (seconds since the request was written)."""

    status: int = 0
    ttfb: float | None = None
    ttfe: float | None = None
    ttft: float | None = None
    total: float | None = None
    events: int = 0
    done: bool = False  # the body ended cleanly (chunked terminator or Content-Length reached)
    keep_alive: bool = True
    error: str | None = None


class ResponseReader:
    """Feed response bytes; it fills an `Exchange`. Chunked and Content-Length bodies."""

    def __init__(self, started: float) -> None:
        self.exchange = Exchange()
        self._started = started
        self._head = bytearray()
        self._in_body = False
        self._chunked = False
        self._left = 0  # bytes left in the current chunk (chunked) or the body (Content-Length)
        self._pending = bytearray()  # an unfinished chunk-size line or chunk trailer
        self._state = "size"  # chunked: size, data, crlf, trailer
        self._carry = b""  # the body's last bytes, for events and content split across reads
        self._seen_content = False

    def feed(self, data: bytes, now: float) -> bytes:
        """Consume `data`; returns bytes after the end of this response (a pipelined surplus)."""
        ex = self.exchange
        if ex.ttfb is None:
            ex.ttfb = now - self._started
        if not self._in_body:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                if len(self._head) > MAX_HEAD:
                    raise ProtocolError("response head too large")
                return b""
            self._parse_head(bytes(self._head[:end]))
            data = bytes(self._head[end + 4 :])
            self._head.clear()
            self._in_body = True
            if not self._chunked and self._left == 0:
                self._finish(now)
                return data
        if self._chunked:
            return self._feed_chunked(data, now)
        body, rest = data[: self._left], data[self._left :]
        self._left -= len(body)
        self._body(body, now)
        if self._left == 0:
            self._finish(now)
        return rest

    def _parse_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ProtocolError(f"bad status line {lines[0][:80]!r}")
        self.exchange.status = int(parts[1])
        length: int | None = None
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "transfer-encoding" and "chunked" in value:
                self._chunked = True
            elif name == "content-length":
                length = int(value)
            elif name == "connection" and value == "close":
                self.exchange.keep_alive = False
        if not self._chunked:
            if length is None:
                raise ProtocolError("a response with neither Content-Length nor chunked encoding")
            self._left = length

    def _feed_chunked(self, data: bytes, now: float) -> bytes:
        view = memoryview(data)
        pos = 0
        while pos < len(view):
            if self._state == "data":
                take = min(self._left, len(view) - pos)
                self._body(bytes(view[pos : pos + take]), now)
                pos += take
                self._left -= take
                if self._left == 0:
                    self._state = "crlf"
                continue
            end = data.find(b"\n", pos)
            if end < 0:
                self._pending += view[pos:]
                if len(self._pending) > 1024:
                    raise ProtocolError("chunk framing line too long")
                return b""
            line = bytes(self._pending) + bytes(view[pos:end])
            self._pending.clear()
            pos = end + 1
            line = line.rstrip(b"\r")
            if self._state == "crlf":
                if line:
                    raise ProtocolError("chunk data not followed by CRLF")
                self._state = "size"
            elif self._state == "size":
                try:
                    self._left = int(line.split(b";", 1)[0], 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size {line[:20]!r}") from None
                self._state = "data" if self._left else "trailer"
            elif not line:  # the empty line that ends the trailer
                self._finish(now)
                return bytes(view[pos:])
        return b""

    def _body(self, data: bytes, now: float) -> None:
        ex = self.exchange
        joined = self._carry + data
        found = joined.count(b"\n\n") - self._carry.count(b"\n\n")
        if found:
            if ex.ttfe is None:
                ex.ttfe = now - self._started
            ex.events += found
        if not self._seen_content and _FIRST_CONTENT.search(joined):
            self._seen_content = True
            ex.ttft = now - self._started
        self._carry = joined[-24:]

    def _finish(self, now: float) -> None:
        self.exchange.done = True
        self.exchange.total = now - self._started
        if not self._chunked and self.exchange.events == 0 and self.exchange.ttft is not None:
            self.exchange.ttfe = self.exchange.ttft  # a whole body: its first event is the body


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reader: ResponseReader | None = None
        self.waiter: asyncio.Future[Exchange] | None = None
        self.on_event: Callable[[Exchange], None] | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        reader, waiter = self.reader, self.waiter
        if reader is None or waiter is None or waiter.done():
            return
        try:
            reader.feed(data, time.perf_counter())
        except (ProtocolError, ValueError) as exc:
            reader.exchange.error = str(exc)
            waiter.set_result(reader.exchange)
            return
        if reader.exchange.done:
            waiter.set_result(reader.exchange)
        elif self.on_event is not None:
            self.on_event(reader.exchange)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.reader is not None and self.waiter is not None and not self.waiter.done():
            self.reader.exchange.error = "the server closed the connection mid-response"
            self.waiter.set_result(self.reader.exchange)


class Client:
    """One simulated client: one keep-alive connection, reopened when the server closes it."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> None:
        self._host, self._port, self._tls = host, port, tls
        self._protocol: _Protocol | None = None

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        server_hostname = self._host if self._tls is not None else None
        transport, protocol = await loop.create_connection(
            _Protocol, self._host, self._port, ssl=self._tls, server_hostname=server_hostname
        )
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return protocol

    async def send(
        self, request: bytes, limit: float, on_event: Callable[[Exchange], None] | None = None
    ) -> Exchange:
        """Write `request` and read the whole response (at most `limit` seconds).

        `on_event` is called after each read that did not end the response; it may call `abandon`."""
        if self._protocol is None or self._protocol.lost:
            self._protocol = await self._connect()
        protocol = self._protocol
        assert protocol.transport is not None
        loop = asyncio.get_running_loop()
        protocol.waiter = loop.create_future()
        started = time.perf_counter()
        protocol.reader = ResponseReader(started)
        protocol.on_event = on_event
        protocol.transport.write(request)
        try:
            exchange = await asyncio.wait_for(protocol.waiter, limit)
        except TimeoutError:
            exchange = protocol.reader.exchange
            exchange.error = f"no complete response within {limit:.0f} s"
        if exchange.error is not None or not exchange.keep_alive:
            self.close()
        return exchange

    def abandon(self) -> float:
        """Close the connection now (the client leaves mid-stream); returns `time.monotonic()` of the close."""
        protocol = self._protocol
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()
            closed_at = time.monotonic()
            if protocol.waiter is not None and not protocol.waiter.done() and protocol.reader is not None:
                protocol.reader.exchange.error = "abandoned"
                protocol.waiter.set_result(protocol.reader.exchange)
            self._protocol = None
            return closed_at
        return time.monotonic()

    def close(self) -> None:
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.close()
        self._protocol = None
