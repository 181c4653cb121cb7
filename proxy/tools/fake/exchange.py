"""One request being answered: the I/O that the normal path and every fault scenario script.

Scenarios say *what* goes on the wire (frames, a raw block, silence, a FIN or an RST); this class does
the writing, the pacing, and the bookkeeping in the request's record, so that every scenario counts its
events and notices a departed client the same way.

A departed client shows up in two ways: with ``handler_cancellation=True`` the handler is cancelled as
soon as the connection drops (noted by the app's handler wrapper), and without it the next write hits a
closing transport (noted here, then ``ClientGone`` unwinds the scenario).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from proxy.tools.fake.bodies import error_body, whole_body
from proxy.tools.fake.generation import GenSpec
from proxy.tools.fake.quirks import STATS, check_quirk
from proxy.tools.fake.recorder import RECORDER, RequestRecord
from proxy.tools.fake.streams import CONTENT, Frame, stream_frames

__all__ = ["SETTINGS", "ClientGone", "Exchange", "FakeSettings", "NormalPlay"]

_YIELD_EVERY = 32  # at full speed, let other streams (and cancellation) in this often


@dataclass(frozen=True, slots=True)
class FakeSettings:
    """How the fake upstream behaves by default; per-request headers and scenarios override it.

    ``token_rate`` paces content events (0: as fast as the socket takes them); a non-streamed answer
    waits as long as its tokens would take. ``tokens`` is the length of an answer when the request sets
    no max-tokens field. ``first_attempt_failures`` is ``fail_first``'s default number of failures.
    ``quirk`` is a behaviour shown on every request (``proxy.tools.fake.quirks``). ``tokenize``: the
    fake serves ``POST /tokenize`` (False: a backend without a tokenizer to ask, 404).
    """

    token_rate: float = 0.0
    tokens: int = 16
    first_attempt_failures: int = 1
    quirk: str | None = None
    tokenize: bool = True

    def __post_init__(self) -> None:
        check_quirk(self.quirk)


SETTINGS: web.AppKey[FakeSettings] = web.AppKey("fake_settings", FakeSettings)

NormalPlay = Callable[["Exchange"], Awaitable[web.StreamResponse]]


class ClientGone(Exception):
    """A write found the peer's connection closing; the scenario cannot go on."""


class Exchange:
    """The request, its record, what to generate, and the response being written."""

    def __init__(
        self,
        request: web.Request,
        record: RequestRecord,
        *,
        api: str,
        body: bytes,
        spec: GenSpec | None,
        rate: float,
        normal: NormalPlay,
    ) -> None:
        self.request = request
        self.record = record
        self.api = api
        self.body = body
        self.spec = spec
        self.rate = rate
        self._normal = normal
        self._recorder = request.app[RECORDER]
        self._stats = request.app[STATS]
        self.response: web.StreamResponse | None = None
        self.content_sent = 0  # content events written (one token of one choice each)

    @property
    def settings(self) -> FakeSettings:
        return self.request.app[SETTINGS]

    def generation(self) -> GenSpec:
        """The request's generation spec; scenarios that stream are only offered where one exists."""
        if self.spec is None:
            raise RuntimeError(f"{self.api} requests have no generation")
        return self.spec

    def frames(self) -> list[Frame]:
        return stream_frames(self.generation())

    async def normal(self) -> web.StreamResponse:
        """Answer as a healthy server would (what the route does without a fault)."""
        return await self._normal(self)

    # -- whole bodies ---------------------------------------------------------------------------------

    def json(self, body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
        return web.Response(body=orjson.dumps(body), status=status, headers=headers, content_type="application/json")

    def error(
        self, status: int, message: str, *, code: str | int | None = None, headers: dict[str, str] | None = None
    ) -> web.Response:
        """An error in the dialect's own shape (Anthropic for ``messages``, else OpenAI)."""
        return self.json(error_body(self.api, status, message, code=code), status, headers)

    async def whole(self) -> web.Response:
        """The non-streamed answer, after the time the tokens would take at the current rate."""
        spec = self.generation()
        if self.rate > 0:
            await asyncio.sleep(spec.tokens / self.rate)
        self._stats.generated += spec.completion_tokens
        return self.json(whole_body(spec))

    # -- streams --------------------------------------------------------------------------------------

    async def open_stream(self) -> web.StreamResponse:
        """Send the 200 and SSE headers; the body follows event by event."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
        )
        self.response = response
        self.record.stream = True
        try:
            await response.prepare(self.request)
        except ConnectionResetError:
            self._gone()
        return response

    async def send(self, frames: Sequence[Frame]) -> None:
        """Write frames one write each; content frames are paced at ``rate`` per second."""
        loop = asyncio.get_running_loop()
        interval = 1.0 / self.rate if self.rate > 0 else 0.0
        next_at = loop.time()
        for count, frame in enumerate(frames, 1):
            if frame.kind == CONTENT and interval:
                delay = next_at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                next_at = max(next_at, loop.time()) + interval  # late: no catch-up burst
            elif not interval and count % _YIELD_EVERY == 0:
                await asyncio.sleep(0)
            await self.send_raw(frame.raw)
            if frame.kind == CONTENT:
                self.content_sent += 1
                self._stats.generated += 1

    async def send_raw(self, data: bytes, *, counts: bool = True) -> None:
        """Write bytes into the body as they are; ``counts`` says whether they are one SSE event."""
        if self.response is None:
            raise RuntimeError("open_stream() first")
        try:
            await self.response.write(data)
        except ConnectionResetError:
            self._gone()
        if counts:
            self.record.events_sent += 1

    async def hold(self, seconds: float) -> None:
        """Stay silent with the connection open (until the client leaves: then we are cancelled)."""
        await asyncio.sleep(seconds)

    def finish(self) -> web.StreamResponse:
        """End the body properly (terminating chunk); what a server does when its generator returns."""
        if self.response is None:
            raise RuntimeError("open_stream() first")
        return self.response

    def close(self) -> web.StreamResponse:
        """Close the TCP connection (FIN) where we are: a chunked body left unterminated."""
        transport = self.request.transport
        if transport is not None:
            transport.close()
        return self.response if self.response is not None else web.Response()

    def reset(self) -> web.StreamResponse:
        """Abort the TCP connection with an RST (SO_LINGER 0), dropping anything unsent."""
        transport = self.request.transport
        if transport is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                # Not every transport is a TCP socket; an abort is still an abort.
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
        return self.response if self.response is not None else web.Response()

    def _gone(self) -> None:
        self._recorder.client_closed(self.record)
        raise ClientGone
