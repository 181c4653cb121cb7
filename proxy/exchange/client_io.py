"""Writing to the client: commit the status line once, count bytes, and notice a client that stalls.

Two ways to write. A stream's relay writes from the upstream's callbacks with `write_raw` (framed
as the response needs, one `transport.write` each) and hears the transport's flow-control events
through `on_flow`. Everything else goes through aiohttp's response writer, whose waits for the
client to drain are bounded by --client-stall-timeout, after which the client counts as gone
(`ClientStalled`). A write that finds the socket closed raises `ConnectionError`.

A whole response (the proxy's own error JSON, or an upstream body read whole) is written here, to
its last byte, before the exchange is booked: a client that leaves during it is an abort, not `ok`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol, cast

from aiohttp import web
from multidict import CIMultiDict

from proxy.core.lifecycle import Lifecycle
from proxy.core.record import ExchangeRecord

__all__ = ["ClientStalled", "ClientWriter", "FlowHooks"]

_Hook = Callable[[], None]
_HEAD_ROOM = 8192  # a status line and headers


class ClientStalled(Exception):
    """The client stopped reading for longer than --client-stall-timeout."""


class FlowHooks(Protocol):
    """The main port's connection protocol calls these from its pause_writing/resume_writing."""

    flow_hooks: tuple[_Hook, _Hook] | None
    writing_paused: bool


class ClientWriter:
    __slots__ = ("_chunked", "ex", "life", "request", "response", "stall_timeout")

    def __init__(self, request: web.BaseRequest, ex: ExchangeRecord, life: Lifecycle, stall_timeout: float) -> None:
        self.request = request
        self.ex = ex
        self.life = life
        self.stall_timeout = stall_timeout
        self.response: web.StreamResponse | None = None
        self._chunked = False

    async def commit(self, response: web.StreamResponse) -> None:
        """Send the status line and headers (once)."""
        if self.response is None:
            self.response = response
            self.ex.status = response.status
            self.life.committed_now()
            await self._guarded(response.prepare(self.request))
            self._chunked = "chunked" in response.headers.get("Transfer-Encoding", "").lower()

    async def write(self, data: bytes) -> None:
        response = self.response
        assert response is not None, "commit first"
        await self._guarded(response.write(data), len(data))
        self.ex.bytes_out += len(data)

    def write_raw(self, data: bytes) -> bool:
        transport = self.request.transport
        if transport is None or transport.is_closing():
            return False
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        return True

    def on_flow(self, paused: object, drained: object) -> None:
        protocol = cast(FlowHooks, self.request.protocol)
        protocol.flow_hooks = (cast(_Hook, paused), cast(_Hook, drained))
        if protocol.writing_paused:
            cast(_Hook, paused)()

    def release_flow(self) -> None:
        protocol = cast(FlowHooks, self.request.protocol)
        if getattr(protocol, "flow_hooks", None) is not None:
            protocol.flow_hooks = None

    async def finish(self) -> None:
        """The body is complete: its end goes out (the last chunk), and the client takes it in."""
        assert self.response is not None
        await self._guarded(self.response.write_eof())

    async def whole(
        self,
        status: int,
        body: bytes,
        headers: CIMultiDict[str] | dict[str, str],
        *,
        reason: str | None = None,
        content_type: str | None = "application/json",
        close: bool = False,
    ) -> web.Response:
        """A whole response (nothing was committed before it), written to its end.

        The proxy's own error JSON, or an upstream body read whole (`content_type=None`: its own
        headers say what it is). `close`: the connection closes after it.
        """
        response = web.Response(status=status, reason=reason, body=body, content_type=content_type, headers=headers)
        if close:
            response.force_close()
        self.response = response
        self.ex.status = status
        self.life.committed_now()
        await self._guarded(response.prepare(self.request))
        await self._guarded(response.write_eof(), len(body))
        self.ex.bytes_out = len(body)
        return response

    def close_now(self) -> None:
        """Close the connection once what was written has gone, without reading the rest of the request
        body first (aiohttp's lingering read): for a client that stopped sending it, or at shutdown."""
        protocol = self.request.protocol
        if protocol is not None:
            protocol.force_close()

    async def _guarded(self, operation: Awaitable[object], size: int = 0) -> None:
        if self._has_room(size):
            await operation  # it cannot wait for the client: no timer needed
            return
        try:
            async with asyncio.timeout(self.stall_timeout):
                await operation
        except TimeoutError:
            raise ClientStalled from None

    def _has_room(self, size: int) -> bool:
        """Writing `size` more bytes (and a head) cannot wait: the transport is below its high-water
        mark and stays below it, so aiohttp's drain returns at once."""
        transport = self.request.transport
        if transport is None:
            return True  # the write will raise on its own
        if cast(FlowHooks, self.request.protocol).writing_paused:
            return False
        return transport.get_write_buffer_size() + size + _HEAD_ROOM <= transport.get_write_buffer_limits()[1]

    def cut(self) -> web.StreamResponse:
        """Drop the client connection without another byte (no second HTTP response in the body)."""
        transport = self.request.transport
        if transport is not None:
            transport.abort()
        return self.response or web.StreamResponse()
