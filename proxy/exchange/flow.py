"""One body buffer with flow control, for both directions: a client's request body and a whole
upstream body.

The connection's callbacks put pieces in; one coroutine takes them all at once, waiting only when
nothing came. Past `high_water` unread bytes the connection stops reading, and reads again once they
are taken, so a slow reader never makes the proxy hold more than that (uvicorn's `FlowControl`
serves both its protocols the same way).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

__all__ = ["BodyBuffer", "Reading"]


class Reading(Protocol):
    """The connection a body comes on, as far as flow control goes."""

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class BodyBuffer:
    __slots__ = ("_eof", "_error", "_paused", "_pieces", "_size", "_source", "_waiter", "high_water")

    def __init__(self, source: Reading, high_water: int) -> None:
        self._source = source
        self._pieces: list[bytes] = []
        self._size = 0
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self.high_water = high_water

    # ---- the connection's side ----------------------------------------------------------------------

    def put(self, data: bytes) -> None:
        self._pieces.append(data)
        self._size += len(data)
        if self._size > self.high_water and not self._paused:
            self._paused = True
            self._source.pause_reading()
        self._wake()

    def put_eof(self) -> None:
        self._eof = True
        self._wake()

    def set_exception(self, error: BaseException) -> None:
        """The next (or the current) take raises `error`; the first one set stays."""
        if self._error is None:
            self._error = error
        self._wake()

    # ---- the reading coroutine's side ---------------------------------------------------------------

    def is_eof(self) -> bool:
        """The body was received to its end."""
        return self._eof

    @property
    def whole(self) -> bool:
        """The body came to its end and nothing failed it: every take from now on is at once."""
        return self._eof and self._error is None

    @property
    def settled(self) -> bool:
        """The body's end or its failure came: no take from now on waits."""
        return self._eof or self._error is not None

    @property
    def size(self) -> int:
        """The bytes put and not yet taken."""
        return self._size

    @property
    def at_eof(self) -> bool:
        return self._eof and not self._pieces

    @property
    def ready(self) -> bool:
        """A take would not wait: a piece, the end or an error came."""
        return bool(self._pieces) or self._eof or self._error is not None

    async def wait(self) -> None:
        """Until something came (bound it with a timeout where a silence matters)."""
        if self.ready:
            return
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def take(self) -> bytes:
        """What came since the last take (b"" for nothing); raises the error set, if any."""
        if self._error is not None:
            raise self._error
        if not self._pieces:
            return b""
        pieces, self._pieces, self._size = self._pieces, [], 0
        if self._paused:
            self._paused = False
            self._source.resume_reading()
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
