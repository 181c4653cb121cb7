"""Writing to the client: commit the status line once, count bytes, and notice a client that stalls.

aiohttp's `StreamResponse.write` waits on the transport's drain when the client's buffer is full,
which gives backpressure for free: while it waits, the proxy stops reading the upstream. The wait is
bounded by --client-stall-timeout, after which the client counts as gone (`client_stalled`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from aiohttp import web

from .exchange import Exchange

__all__ = ["ClientStalled", "ClientWriter"]


class ClientStalled(Exception):
    """The client stopped reading for longer than --client-stall-timeout."""


class ClientWriter:
    def __init__(self, request: web.BaseRequest, response: web.StreamResponse, ex: Exchange, stall_timeout: float):
        self.request = request
        self.response = response
        self.ex = ex
        self.stall_timeout = stall_timeout

    @property
    def committed(self) -> bool:
        return self.response.prepared

    async def commit(self) -> None:
        if not self.response.prepared:
            self.ex.status = self.response.status
            self.ex.committed = True
            await self._guarded(self.response.prepare(self.request))

    async def write(self, data: bytes) -> None:
        if not self.response.prepared:
            await self.commit()
        if self._has_room(len(data)):
            await self.response.write(data)  # cannot block: no timer needed on the hot path
        else:
            await self._guarded(self.response.write(data))
        self.ex.bytes_out += len(data)

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

    def abort(self) -> None:
        """Drop the client connection without another byte (no second HTTP response in the body)."""
        transport = self.request.transport
        if transport is not None:
            transport.abort()
