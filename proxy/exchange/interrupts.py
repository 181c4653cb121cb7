"""Shutdown, or the client's departure, reaching an exchange as an event inside the wait it is in,
not as a task cancel.

The server cannot know what a running exchange waits on; the exchange tells its `Interrupter` (the
client's body, a `ClientBody`; an upstream body, read through a `BodyReader`; a stream relay, which
takes it as an event; the wait for the upstream's headers, under its first-byte deadline) and `fire`
wakes that wait with its `Cause`: a reader raises `Interrupted`, a relay ends its stream, a deadline
is moved to now. The exchange turns each into its lifecycle's event (`told`): `interrupted` for
shutdown, `client_gone` for a client that left (its connection fires it from `connection_lost`).
The first cause wins, as the lifecycle's first ending does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from enum import StrEnum

from proxy.core.lifecycle import Answer, Lifecycle
from proxy.exchange.deadline import Movable

__all__ = ["Cause", "Interrupted", "Interrupter", "told"]


class Cause(StrEnum):
    SHUTDOWN = "shutdown"  # shutdown's drain time is over
    CLIENT_GONE = "client_gone"  # the client's connection closed


class Interrupted(Exception):
    """The wait was interrupted: shutdown, or the client left (`cause`)."""

    def __init__(self, cause: Cause = Cause.SHUTDOWN) -> None:
        super().__init__(str(cause))
        self.cause = cause


def told(life: Lifecycle, cause: Cause) -> Answer | None:
    """The lifecycle's event for an interruption's cause."""
    return life.interrupted() if cause is Cause.SHUTDOWN else life.client_gone()


class Interrupter:
    __slots__ = ("_deadline", "_on_fire", "cause")

    def __init__(self) -> None:
        self.cause: Cause | None = None
        self._on_fire: Callable[[Cause], None] | None = None
        self._deadline: Movable | None = None

    @property
    def fired(self) -> bool:
        return self.cause is not None

    def error(self) -> Interrupted:
        """What a wait raises once fired."""
        return Interrupted(self.cause or Cause.SHUTDOWN)

    def watch(self, on_fire: Callable[[Cause], None]) -> None:
        """What the exchange waits on now is woken by `on_fire` (at once if fired already)."""
        self._on_fire, self._deadline = on_fire, None
        if self.cause is not None:
            on_fire(self.cause)

    def watch_deadline(self, deadline: Movable) -> None:
        """The exchange waits under `deadline` (for the upstream's headers); firing moves it to now,
        and the wait's TimeoutError is then read as `Interrupted` (see `fired`)."""
        self._on_fire, self._deadline = None, deadline
        if self.cause is not None:
            deadline.reschedule(asyncio.get_running_loop().time())

    def forget(self) -> None:
        """The exchange is over: what it waited on is no longer woken (nor held)."""
        self._on_fire, self._deadline = None, None

    def fire(self, cause: Cause = Cause.SHUTDOWN) -> None:
        if self.cause is not None:
            return
        self.cause = cause
        if self._on_fire is not None:
            self._on_fire(cause)
        if self._deadline is not None and not self._deadline.expired():
            with contextlib.suppress(RuntimeError):  # the wait just ended
                self._deadline.reschedule(asyncio.get_running_loop().time())
