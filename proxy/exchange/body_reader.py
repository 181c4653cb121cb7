"""A whole upstream body read piece by piece by a coroutine, with the transport's flow control.

The sink side is called by the upstream connection's callbacks; `read` returns what has come (all
of it, joined) and waits only when nothing has. Past `high_water` unread bytes the connection stops
reading, so a client that is slow to take a large body never makes the proxy hold more than that.
Each wait is bounded by the idle timeout (a body that trickles is not cut while it moves), and
shutdown's `interrupt` wakes it.
"""

from __future__ import annotations

import asyncio

from proxy.exchange.failures import UpstreamFailure, stalled
from proxy.exchange.upstream import UpstreamLink

__all__ = ["HIGH_WATER", "BodyReader"]

HIGH_WATER = 256 * 1024


class BodyReader:
    __slots__ = ("_eof", "_error", "_link", "_paused", "_pieces", "_size", "_tail_bytes", "_waiter", "high_water",
                 "tail")  # fmt: skip

    def __init__(self, link: UpstreamLink, high_water: int = HIGH_WATER) -> None:
        self._link = link
        self._pieces: list[bytes] = []
        self._size = 0
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self.high_water = high_water
        self.tail = b""  # the body's last bytes read, when asked to keep them
        self._tail_bytes = 0
        link.attach(self)

    # ---- BodySink -----------------------------------------------------------------------------------

    def body(self, data: bytes) -> None:
        self._pieces.append(data)
        self._size += len(data)
        if self._size > self.high_water and not self._paused:
            self._paused = True
            self._link.pause_reading()
        self._wake()

    def end(self) -> None:
        self._eof = True
        self._wake()

    def failed(self, failure: UpstreamFailure) -> None:
        self.interrupt(failure)

    def interrupt(self, error: BaseException) -> None:
        """The next (or the current) read raises `error` (a failure, or shutdown's `Interrupted`)."""
        if self._error is None:
            self._error = error
        self._wake()

    # ---- the reading coroutine's side ---------------------------------------------------------------

    def keep_tail(self, start: bytes, size: int) -> None:
        """From now on `tail` holds the last `size` bytes read (`start`: what was read before)."""
        self._tail_bytes = size
        self.tail = start[-size:]

    @property
    def at_eof(self) -> bool:
        return self._eof and not self._pieces

    async def read(self, idle: float) -> bytes:
        """What came since the last read; b"" at the end. Raises the failure, or a stall after `idle` s."""
        if not self._pieces and not self._eof and self._error is None:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(idle):
                    await waiter
            except TimeoutError:
                raise stalled(idle) from None
            finally:
                self._waiter = None
        if self._error is not None:
            raise self._error
        if not self._pieces:
            return b""
        pieces, self._pieces, self._size = self._pieces, [], 0
        if self._paused:
            self._paused = False
            self._link.resume_reading()
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        if self._tail_bytes:
            size = self._tail_bytes
            self.tail = data[-size:] if len(data) >= size else (self.tail + data)[-size:]
        return data

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
