"""A relay between the proxy and a real backend that breaks responses the way networks and backends do.

It forwards each request to the backend on its own connection and relays the answer, one SSE event
per chunk; for the requests its plan names, it breaks the stream after a given number of
content-bearing events: `close` (the connection is reset mid-body), `stall` (nothing more is sent,
the connection stays open until the proxy gives up on it) or `stray` (an `HTTP/1.0 503` block, as
a backend's error handler writes it into a body already started; then silence, until the proxy
closes). Every request body it forwarded is kept, so a test can read what the proxy sent.

A reset can overtake the bytes before it (what the proxy had not read yet may be lost with it; an
HTTP client such as aiohttp also raises the cut before it hands over what it had buffered), so the
events the relay wrote last may never reach the guard, which then continues from what did: what
the client received is what counts. A test that needs the break at an exact point gives the relay a
`Gate`: a `close` waits until the client has seen the events before it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from yarl import URL

__all__ = ["BREAKS", "CutRelay", "Gate", "read_gated"]

BREAKS = ("close", "stall", "stray")
_STRAY_BODY = b'{"error":{"message":"the backend is restarting","code":503}}'
STRAY_503 = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: "
    + str(len(_STRAY_BODY)).encode() + b"\r\n\r\n" + _STRAY_BODY
)
_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"host"})


def _streamed(body: bytes) -> bool:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(obj, dict) and obj.get("stream") is True


def _content(event: bytes) -> bool:
    """An event that carries generated text (a chat delta or a completions choice)."""
    return (b'"content":"' in event and b'"content":""' not in event) or (
        b'"text":"' in event and b'"text":""' not in event
    )


class Gate:
    """Opens a `close` break once the client has received `every` more content events."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.seen = 0
        self.open = asyncio.Event()

    def saw_content(self) -> None:
        """The client received one more content event (call it from the reading loop)."""
        self.seen += 1
        if self.seen % self.every == 0:
            self.open.set()



async def read_gated(stream: AsyncIterable[Any], gate: Gate | None) -> list[dict[str, Any]]:
    """An SDK stream's events, dumped; each one with text (a chat delta's or a completion's) is told to
    `gate`, so that a gated `close` breaks the stream only after the client has it."""
    chunks: list[dict[str, Any]] = []
    async for event in stream:
        chunk = event.model_dump()
        chunks.append(chunk)
        texts = [(ch.get("delta") or {}).get("content") or ch.get("text") for ch in chunk["choices"]]
        if gate is not None and any(texts):
            gate.saw_content()
    return chunks


@dataclass
class CutRelay:
    """`plan[i]` is how the i-th streamed request is broken (None: relayed whole); later ones pass whole."""

    backend: str
    plan: Sequence[str | None]
    after: int = 5  # content events relayed before the break
    gate: Gate | None = None  # a `close` waits for the client to have what came before it
    bodies: list[bytes] = field(default_factory=list)  # every generation request's body, in order
    tokenized: list[bytes] = field(default_factory=list)  # the bodies sent to /tokenize
    broken: int = 0  # responses broken so far
    _server: asyncio.Server | None = None
    _streams: int = 0
    _stalled: list[asyncio.StreamWriter] = field(default_factory=list)

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def start(self) -> CutRelay:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def stop(self) -> None:
        for writer in self._stalled:
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            if writer not in self._stalled:
                writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Relay one request; False when the client connection is over."""
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        request_line, headers = lines[0], [line.split(b":", 1) for line in lines[1:] if b":" in line]
        length = next((int(v) for k, v in headers if k.strip().lower() == b"content-length"), 0)
        body = await reader.readexactly(length)
        (self.tokenized if request_line.split(b" ")[1:2] == [b"/tokenize"] else self.bodies).append(body)
        target = URL(self.backend)
        up_reader, up_writer = await asyncio.open_connection(target.host, target.port)
        try:
            kept = b"".join(k + b":" + v + b"\r\n" for k, v in headers if k.strip().lower() not in _HOP)
            up_writer.write(request_line + b"\r\n" + kept + b"Host: " + str(target.host).encode()
                            + b"\r\nConnection: close\r\nContent-Length: " + str(length).encode() + b"\r\n\r\n" + body)
            relay = asyncio.ensure_future(self._relay(up_reader, writer, _streamed(body)))
            gone = asyncio.ensure_future(reader.read(1))  # the proxy sends nothing more: EOF is its close
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            if not relay.done():  # the proxy closed first: so does the relay, toward the backend
                relay.cancel()
                with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                    await relay
                return False
            return relay.result()
        finally:
            up_writer.close()

    async def _relay(self, up: asyncio.StreamReader, writer: asyncio.StreamWriter, streamed: bool) -> bool:
        head = await up.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status, fields = lines[0], [line.split(b":", 1) for line in lines[1:] if b":" in line]
        chunked = any(k.lower() == b"transfer-encoding" and b"chunked" in v.lower() for k, v in fields)
        length = next((int(v) for k, v in fields if k.strip().lower() == b"content-length"), None)
        kept = b"".join(k + b":" + v + b"\r\n" for k, v in fields if k.strip().lower() not in _HOP)
        writer.write(status + b"\r\n" + kept + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        how: str | None = None
        if streamed:
            how = self.plan[self._streams] if self._streams < len(self.plan) else None
            self._streams += 1
        buffer, seen = b"", 0
        async for piece in self._body(up, chunked, length):
            buffer += piece
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                writer.write(self._chunk(event + b"\n\n"))
                await writer.drain()
                seen += _content(event)
                if how is not None and seen >= self.after:
                    await self._break(how, writer)
                    return False
        if buffer:
            writer.write(self._chunk(buffer))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return False  # (Connection: close)

    async def _break(self, how: str, writer: asyncio.StreamWriter) -> None:
        self.broken += 1
        if how == "stray":
            writer.write(self._chunk(STRAY_503))
            await writer.drain()
        if how in ("stall", "stray"):
            self._stalled.append(writer)  # held open until the proxy closes it, or stop()
            return
        if self.gate is not None:
            await self.gate.open.wait()
            self.gate.open.clear()
        writer.transport.abort()  # a reset mid-body: no terminating chunk ever comes

    @staticmethod
    def _chunk(data: bytes) -> bytes:
        return f"{len(data):x}\r\n".encode() + data + b"\r\n"

    @staticmethod
    async def _body(up: asyncio.StreamReader, chunked: bool, length: int | None) -> AsyncIterator[bytes]:
        if not chunked:
            if length is not None:
                yield await up.readexactly(length)
                return
            while piece := await up.read(65536):
                yield piece
            return
        while True:
            size = int((await up.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                with contextlib.suppress(asyncio.IncompleteReadError):
                    await up.readuntil(b"\r\n")
                return
            yield await up.readexactly(size)
            await up.readexactly(2)
