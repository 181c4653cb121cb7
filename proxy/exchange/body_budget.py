"""One bound on the request-body bytes held in memory at once, across all exchanges.

`--max-body-size` bounds one body; without a total, ten clients each sending just under it hold
ten times that (nginx spills to disk instead; a sidecar has no disk to spare). A body that would go
past `--max-buffered-body-bytes` waits briefly for others to be forwarded, then is refused with a
503 and Retry-After (`proxy_overloaded`).
"""

from __future__ import annotations

import asyncio

__all__ = ["WAIT_SECONDS", "BodyBudget"]

WAIT_SECONDS = 2.0  # how long a body waits for room before its 503


class BodyBudget:
    def __init__(self, limit: int, wait: float = WAIT_SECONDS) -> None:
        self.limit = limit
        self.wait = wait
        self.used = 0
        self._waiters: list[asyncio.Future[None]] = []

    def fits(self, size: int) -> bool:
        """Whether `size` more bytes are within the bound now."""
        return self.used + size <= self.limit

    def take_now(self, size: int) -> bool:
        """Reserve `size` bytes if there is room now (no coroutine to await: the common case)."""
        if not self.fits(size):
            return False
        self.used += size
        return True

    async def take(self, size: int) -> bool:
        """Reserve `size` bytes; False when no room came within the wait."""
        if size > self.limit:
            return False
        if not self.fits(size):
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.wait
            while not self.fits(size):
                waiter = loop.create_future()
                self._waiters.append(waiter)
                try:
                    async with asyncio.timeout_at(deadline):
                        await waiter
                except TimeoutError:
                    return False
                finally:
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)
        self.used += size
        return True

    def give_back(self, size: int) -> None:
        if size <= 0:
            return
        self.used -= size
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:  # each re-checks the room it needs
            if not waiter.done():
                waiter.set_result(None)
