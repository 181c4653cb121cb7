"""Shutdown, or the client's departure, reaching an exchange as an event inside the wait it is in,
not as a task cancel.

The server cannot know what a running exchange waits on; the exchange tells its `Interrupter` (the
client's body, a `ClientBody`; an upstream body, read through a `BodyReader`; a stream relay, which
takes it as an event; the wait for the upstream's headers, under its first-byte deadline) and `fire`
wakes that wait with its `Cause`: a reader raises `Interrupted`, a relay ends its stream, a deadline
is moved to now. The exchange turns each into its lifecycle's event (`told`): `interrupted` for
shutdown, `client_gone` for a client that left (its connection fires it from `connection_lost`).
The first cause wins, as the lifecycle's first ending does.

The proxy's own small error tree is here too: the upstream connections (proxy/server/upstream_conn.py,
upstream_pool.py) raise or deliver an `UpstreamFailure` that already names its reason; the exchange
adds the two failures only it can see (its first-byte deadline, a body that stops arriving), and a
`Refusal` when it will not forward. Everything past this boundary reasons about a `Reason` and a
message, and no exception text or class name ever reaches a client.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from enum import StrEnum

from proxy.core.lifecycle import Answer, Lifecycle, Reason
from proxy.exchange.deadline import Movable

__all__ = [
    "Cause", "Interrupted", "Interrupter", "Refusal", "UpstreamFailure", "first_byte_timeout", "stalled", "told",
]


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


class Refusal(Exception):
    """The proxy will not forward this request: a bad target, a body too large or too slow, no room."""

    def __init__(self, reason: Reason, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.reason, self.message, self.headers = reason, message, headers or {}


class UpstreamFailure(Exception):
    """The upstream (or the way to it) failed: no connection, no answer in time, broken HTTP, a cut."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


def first_byte_timeout(seconds: float) -> UpstreamFailure:
    return UpstreamFailure(Reason.FIRST_BYTE_TIMEOUT, f"the upstream sent no response headers within {seconds:g} s")


def stalled(seconds: float) -> UpstreamFailure:
    return UpstreamFailure(Reason.STALL_TIMEOUT, f"the upstream sent nothing for {seconds:g} s")
