"""Writing to the client: commit the status line once, count bytes, and notice a client that stalls.

aiohttp's `StreamResponse.write` waits on the transport's drain when the client's buffer is full,
which gives backpressure for free: while it waits, the proxy stops reading the upstream. The wait is
bounded by --client-stall-timeout, after which the client counts as gone (`ClientStalled`). A write
that finds the socket closed raises `ConnectionError` (aiohttp's `ClientConnectionResetError`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from aiohttp import web
from multidict import CIMultiDict

from proxy.core.lifecycle import Lifecycle
from proxy.core.record import ExchangeRecord

__all__ = ["ClientStalled", "ClientWriter"]


class ClientStalled(Exception):
    """The client stopped reading for longer than --client-stall-timeout."""


class ClientWriter:
    __slots__ = ("ex", "life", "request", "response", "stall_timeout")

    def __init__(self, request: web.BaseRequest, ex: ExchangeRecord, life: Lifecycle, stall_timeout: float) -> None:
        self.request = request
        self.ex = ex
        self.life = life
        self.stall_timeout = stall_timeout
        self.response: web.StreamResponse | None = None

    async def commit(self, response: web.StreamResponse) -> None:
        """Send the status line and headers (once)."""
        if self.response is None:
            self.response = response
            self.ex.status = response.status
            self.life.committed_now()
            await self._guarded(response.prepare(self.request))

    async def write(self, data: bytes) -> None:
        response = self.response
        assert response is not None, "commit first"
        if self._has_room(len(data)):
            await response.write(data)  # cannot block: no timer needed on the hot path
        else:
            await self._guarded(response.write(data))
        self.ex.bytes_out += len(data)

    def whole(
        self,
        status: int,
        body: bytes,
        headers: CIMultiDict[str] | dict[str, str],
        *,
        reason: str | None = None,
        content_type: str | None = "application/json",
    ) -> web.Response:
        """A whole response, given to aiohttp to write at once (nothing was committed before it).

        The proxy's own error JSON, or an upstream body read whole (`content_type=None`: its own
        headers say what it is).
        """
        self.ex.status, self.ex.bytes_out = status, len(body)
        return web.Response(status=status, reason=reason, body=body, content_type=content_type, headers=headers)

    def _has_room(self, size: int) -> bool:
        """The write cannot wait: writing is not paused and this write will not pause it.

        aiohttp only waits (drains) on a paused transport, and the transport pauses once its buffer
        goes above the high-water mark; below it, a write returns at once and needs no timer.
        (uvloop's low-water mark is 16 bytes, so the high mark is the one to compare with.)
        """
        transport = self.request.transport
        if transport is None:
            return True  # the write will raise on its own
        if self.request.protocol.writing_paused:
            return False
        return transport.get_write_buffer_size() + size <= transport.get_write_buffer_limits()[1]

    async def _guarded(self, operation: Awaitable[object]) -> None:
        try:
            async with asyncio.timeout(self.stall_timeout):
                await operation
        except TimeoutError:
            raise ClientStalled from None

    def cut(self) -> web.StreamResponse:
        """Drop the client connection without another byte (no second HTTP response in the body)."""
        transport = self.request.transport
        if transport is not None:
            transport.abort()
        return self.response or web.StreamResponse()
