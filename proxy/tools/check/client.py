"""The check's one connection to the backend: plain requests with a timeout each, and streams read
event by event with the proxy's own SSE reader, so a stray HTTP block or a cut is seen as the proxy
would see it. Every transport failure becomes ``Unreachable`` (before any answer) or is recorded on the
stream (after), never a traceback.

Bounded against a hostile or broken backend: a body is read up to ``max_body`` bytes (more
is ``Overflow``, a kind of ``Unreachable``, so each probe reports it as a finding), and a stream up to
``max_body`` bytes and ``stream_deadline`` seconds in all (past either it is recorded as cut): a 1.5 GB
``/metrics``, a flood of events or one event a second forever cannot grow the check or hold it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from yarl import URL

from proxy.core.sse import Event, SSEReader, StatusBlock

__all__ = ["MAX_BODY", "MAX_EVENTS", "Overflow", "Reply", "Stream", "Unreachable", "Upstream", "error_message"]

MAX_BODY = 16 * 1024 * 1024  # bytes of one answer or stream: a probe asks for 8-2048 tokens
MAX_EVENTS = 20_000  # events of one stream (each is a Python object: bytes alone would not bound memory)


class Unreachable(Exception):
    """No HTTP answer at all: refused, reset before the status line, DNS, or the probe's timeout."""


class Overflow(Unreachable):
    """An answer larger than the check reads: not a usable answer, said as such."""


@dataclass(slots=True)
class Reply:
    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        try:
            return orjson.loads(self.body)
        except orjson.JSONDecodeError:
            return None


@dataclass(slots=True)
class Stream:
    """An SSE response being read: its status and headers, then ``items`` as they arrive."""

    status: int
    headers: Mapping[str, str]
    items: list[Event | StatusBlock] = field(default_factory=list)
    cut: str | None = None  # how the body broke, if it did (reset, unterminated chunked body, timeout)
    body: bytes = b""  # a non-SSE answer (an error status) is read whole instead

    @property
    def events(self) -> list[Event]:
        return [i for i in self.items if isinstance(i, Event) and i.has_data]


def error_message(body: Any) -> str | None:
    """The message of an error body in any shape backends use (nested, flat, FastAPI's detail)."""
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    if isinstance(error, str):
        return error
    for key in ("message", "detail"):
        if isinstance(body.get(key), str):
            return str(body[key])
    return None


class Upstream:
    """The backend at ``base``; ``timeout`` bounds each request (a stream: each read too)."""

    def __init__(
        self, base: str, *, api_key: str | None, timeout: float, max_body: int = MAX_BODY,
        stream_deadline: float | None = None, max_events: int = MAX_EVENTS,
    ) -> None:
        self.base = URL(base.rstrip("/") or base)
        self.timeout = timeout
        self.max_body = max_body
        self.max_events = max_events
        self.stream_deadline = stream_deadline if stream_deadline is not None else 2 * timeout
        self._headers = {"User-Agent": "streamwarden-check"}
        if api_key:
            self._headers |= {"Authorization": f"Bearer {api_key}", "x-api-key": api_key}
        self.server_header: str | None = None
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Upstream:
        # No total timeout: a stream may run longer than one read; each wait below carries its own. A new
        # connection per request: a server that closes idle keep-alive connections (llama-server after a
        # stream) must not turn a probe into a "server disconnected", and probes stay independent.
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(force_close=True)
        )
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("use Upstream in `async with`")
        return self._session

    def url(self, path: str) -> URL:
        return self.base.with_path(self.base.path.rstrip("/") + path, encoded=False)

    async def get(self, path: str) -> Reply:
        return await self.request("GET", path)

    async def post(self, path: str, body: Any, headers: Mapping[str, str] | None = None) -> Reply:
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        return await self.request("POST", path, data, headers)

    async def request(
        self, method: str, path: str, data: bytes | None = None, headers: Mapping[str, str] | None = None
    ) -> Reply:
        sent = self._headers | {"Content-Type": "application/json"} | dict(headers or {})
        try:
            async with asyncio.timeout(self.timeout):
                async with self.session.request(method, self.url(path), data=data, headers=sent) as resp:
                    self._note_server(resp)
                    return Reply(resp.status, resp.headers, await self._bounded(resp, f"{method} {path}"))
        except TimeoutError:
            raise Unreachable(f"no answer within {self.timeout:g} s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise Unreachable(_describe(exc)) from None

    @asynccontextmanager
    async def stream(
        self, path: str, body: Any, headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[tuple[Stream, AsyncIterator[Event | StatusBlock]]]:
        """Open a streamed POST; yields the ``Stream`` and an iterator of its items. Leaving the block
        closes the connection (not returned to a pool), which is how a client abandons a stream."""
        sent = self._headers | {"Content-Type": "application/json"} | dict(headers or {})
        try:
            async with asyncio.timeout(self.timeout):
                resp = await self.session.post(self.url(path), data=orjson.dumps(body), headers=sent)
        except TimeoutError:
            raise Unreachable(f"no response headers within {self.timeout:g} s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise Unreachable(_describe(exc)) from None
        self._note_server(resp)
        stream = Stream(resp.status, resp.headers)
        try:
            yield stream, self._items(resp, stream)
        finally:
            resp.close()

    async def _bounded(self, resp: aiohttp.ClientResponse, what: str) -> bytes:
        """The body, up to ``max_body`` bytes; ``Overflow`` past it (the rest is never read)."""
        chunks: list[bytes] = []
        size = 0
        while chunk := await resp.content.readany():
            size += len(chunk)
            if size > self.max_body:
                raise Overflow(f"{what} answered more than {_size(self.max_body)} (the check reads no more)")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _items(self, resp: aiohttp.ClientResponse, stream: Stream) -> AsyncIterator[Event | StatusBlock]:
        if not (200 <= resp.status < 300) or "event-stream" not in resp.headers.get("Content-Type", ""):
            try:
                async with asyncio.timeout(self.timeout):
                    stream.body = await self._bounded(resp, f"a {resp.status} answer to a stream")
            except Overflow as exc:
                stream.cut = str(exc)
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                stream.cut = _describe(exc)
            return
        reader = SSEReader()
        size = 0
        ends = asyncio.get_running_loop().time() + self.stream_deadline
        while True:
            left = ends - asyncio.get_running_loop().time()
            if left <= 0:
                stream.cut = f"still streaming after {self.stream_deadline:g} s (the check's bound on a stream)"
                return
            try:
                async with asyncio.timeout(min(self.timeout, left)):
                    chunk = await resp.content.readany()
            except TimeoutError:
                if left <= self.timeout:
                    continue  # the stream's own deadline: said above
                stream.cut = f"silent for {self.timeout:g} s"
                return
            except (aiohttp.ClientError, OSError) as exc:
                stream.cut = _describe(exc)
                tail = reader.close()
                stream.items += tail
                for item in tail:
                    yield item
                return
            size += len(chunk)
            if size > self.max_body:
                stream.cut = f"the stream passed {_size(self.max_body)} (the check reads no more)"
                return
            items = reader.close() if not chunk else reader.feed(chunk)
            if len(stream.items) + len(items) > self.max_events:
                stream.cut = f"the stream sent more than {self.max_events:,} events (the check reads no more)"
                return
            stream.items += items
            for item in items:
                yield item
            if not chunk:
                return

    def _note_server(self, resp: aiohttp.ClientResponse) -> None:
        if self.server_header is None and resp.headers.get("Server"):
            self.server_header = resp.headers["Server"]


def _size(n: int) -> str:
    return f"{n // (1024 * 1024)} MiB" if n >= 1024 * 1024 and n % (1024 * 1024) == 0 else f"{n:,} bytes"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, aiohttp.ClientConnectorError):
        if isinstance(exc.os_error, ConnectionRefusedError):
            return "connection refused (nothing listens there)"
        return f"cannot connect: {exc.os_error.strerror or exc.os_error}"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "the body ended unterminated (connection closed mid-body)"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the server closed the connection"
    if isinstance(exc, ConnectionResetError):
        return "connection reset"
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]
