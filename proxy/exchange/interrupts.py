"""Shutdown reaching an exchange as an exception raised inside the wait it is in, not as a cancel.

The server cannot know what a running exchange waits on; the exchange tells its `Interrupter` (the
client's body or the upstream's, read through an aiohttp `StreamReader`; the wait for the
upstream's headers, under its first-byte deadline) and `fire` wakes that wait: a reader raises
`Interrupted`, a deadline is moved to now. The exchange turns either into its lifecycle's
`interrupted` event; a handler cancellation thus always means the client left.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

__all__ = ["Interrupted", "Interrupter"]


class Interrupted(Exception):
    """Shutdown's drain time is over."""


class Interrupter:
    __slots__ = ("_deadline", "_reader", "fired")

    def __init__(self) -> None:
        self.fired = False
        self._reader: aiohttp.StreamReader | None = None
        self._deadline: asyncio.Timeout | None = None

    def watch(self, reader: aiohttp.StreamReader) -> None:
        """Reads of `reader` are what the exchange waits on now."""
        self._reader, self._deadline = reader, None
        if self.fired:
            reader.set_exception(Interrupted())

    def watch_deadline(self, deadline: asyncio.Timeout) -> None:
        """The exchange waits under `deadline` (for the upstream's headers); firing moves it to now,
        and the wait's TimeoutError is then read as `Interrupted` (see `fired`)."""
        self._reader, self._deadline = None, deadline
        if self.fired:
            deadline.reschedule(asyncio.get_running_loop().time())

    def fire(self) -> None:
        if self.fired:
            return
        self.fired = True
        if self._reader is not None:
            self._reader.set_exception(Interrupted())
        if self._deadline is not None and not self._deadline.expired():
            with contextlib.suppress(RuntimeError):  # the wait just ended
                self._deadline.reschedule(asyncio.get_running_loop().time())
