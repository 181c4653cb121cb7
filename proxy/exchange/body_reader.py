"""A whole upstream body read piece by piece by a coroutine, with the transport's flow control.

The sink side is called by the upstream connection's callbacks; `read` returns what has come (all
of it, joined) and waits only when nothing has. Past `high_water` unread bytes the connection stops
reading, so a client that is slow to take a large body never makes the proxy hold more than that.
Each wait is bounded by the idle timeout (a body that trickles is not cut while it moves), and
shutdown's `interrupt` wakes it.
"""

from __future__ import annotations

import asyncio

from proxy.exchange.errors import UpstreamFailure, stalled
from proxy.exchange.flow import BodyBuffer
from proxy.exchange.upstream import UpstreamLink

__all__ = ["HIGH_WATER", "BodyReader"]

HIGH_WATER = 256 * 1024


class BodyReader(BodyBuffer):
    __slots__ = ("_tail_bytes", "tail")

    def __init__(self, link: UpstreamLink, high_water: int = HIGH_WATER) -> None:
        super().__init__(link, high_water)
        self.tail = b""  # the body's last bytes read, when asked to keep them
        self._tail_bytes = 0
        link.attach(self)

    # ---- BodySink -----------------------------------------------------------------------------------

    def body(self, data: bytes) -> None:
        self.put(data)

    def end(self) -> None:
        self.put_eof()

    def failed(self, failure: UpstreamFailure) -> None:
        self.set_exception(failure)

    def interrupt(self, error: BaseException) -> None:
        """The next (or the current) read raises `error` (a failure, or an `Interrupted`)."""
        self.set_exception(error)

    # ---- the reading coroutine's side ---------------------------------------------------------------

    def keep_tail(self, start: bytes, size: int) -> None:
        """From now on `tail` holds the last `size` bytes read (`start`: what was read before)."""
        self._tail_bytes = size
        self.tail = start[-size:]

    async def read(self, idle: float) -> bytes:
        """What came since the last read; b"" at the end. Raises the failure, or a stall after `idle` s."""
        if not self.ready:
            try:
                async with asyncio.timeout(idle):
                    await self.wait()
            except TimeoutError:
                raise stalled(idle) from None
        data = self.take()
        if self._tail_bytes and data:
            size = self._tail_bytes
            self.tail = data[-size:] if len(data) >= size else (self.tail + data)[-size:]
        return data
