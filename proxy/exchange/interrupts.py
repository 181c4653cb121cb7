"""Shutdown reaching an exchange as an event inside the wait it is in, not as a cancel.

The server cannot know what a running exchange waits on; the exchange tells its `Interrupter` (the
client's body, a `ClientBody`; an upstream body, read through a
`BodyReader`; a stream relay, which takes it as an event; the wait for the upstream's headers,
under its first-byte deadline) and `fire` wakes that wait: a reader raises `Interrupted`, a relay
ends its stream, a deadline is moved to now. The exchange turns each into its lifecycle's
`interrupted` event; a handler cancellation thus always means the client left.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

__all__ = ["Interrupted", "Interrupter"]


class Interrupted(Exception):
    """Shutdown's drain time is over."""


class Interrupter:
    __slots__ = ("_deadline", "_on_fire", "fired")

    def __init__(self) -> None:
        self.fired = False
        self._on_fire: Callable[[], None] | None = None
        self._deadline: asyncio.Timeout | None = None

    def watch(self, on_fire: Callable[[], None]) -> None:
        """What the exchange waits on now is woken by `on_fire` (at once if shutdown already came)."""
        self._on_fire, self._deadline = on_fire, None
        if self.fired:
            on_fire()

    def watch_deadline(self, deadline: asyncio.Timeout) -> None:
        """The exchange waits under `deadline` (for the upstream's headers); firing moves it to now,
        and the wait's TimeoutError is then read as `Interrupted` (see `fired`)."""
        self._on_fire, self._deadline = None, deadline
        if self.fired:
            deadline.reschedule(asyncio.get_running_loop().time())

    def fire(self) -> None:
        if self.fired:
            return
        self.fired = True
        if self._on_fire is not None:
            self._on_fire()
        if self._deadline is not None and not self._deadline.expired():
            with contextlib.suppress(RuntimeError):  # the wait just ended
                self._deadline.reschedule(asyncio.get_running_loop().time())
