"""`asyncio.timeout` for a loop already at hand: the same contract, without asking for the loop.

On CPython 3.11 each `asyncio.get_running_loop()` (and `current_task()` without a loop) makes a
`getpid()` system call, and `asyncio.timeout` asks three times: three system calls on every
request's wait for the upstream's head. A `Deadline` is given the loop; its timer is a
`loop.call_at`, and on expiry it cancels the task and raises `TimeoutError` at the block's end,
as asyncio's own does (a cancel from elsewhere stays a cancel).
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Protocol

__all__ = ["Deadline", "Movable"]


class Movable(Protocol):
    """A deadline an interrupter can move to now (`Deadline`, or asyncio's `Timeout`)."""

    def reschedule(self, when: float | None) -> None: ...

    def expired(self) -> bool: ...


class Deadline:
    __slots__ = ("_cancelling", "_entered", "_exited", "_expired", "_handle", "_loop", "_task", "_when")

    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float | None) -> None:
        self._loop = loop
        self._when = None if delay is None else loop.time() + delay
        self._handle: asyncio.Handle | None = None
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self._entered = self._exited = self._expired = False

    def when(self) -> float | None:
        return self._when

    def expired(self) -> bool:
        return self._expired

    def reschedule(self, when: float | None) -> None:
        if not self._entered or self._exited or self._expired:
            raise RuntimeError("the deadline's block is not running")
        self._when = when
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if when is not None:
            loop = self._loop
            self._handle = loop.call_soon(self._fire) if when <= loop.time() else loop.call_at(when, self._fire)

    async def __aenter__(self) -> Deadline:
        return self.__enter__()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.__exit__(exc_type, exc, tb)

    def __enter__(self) -> Deadline:
        """(A plain `with` inside the task works as well as `async with`, and makes no coroutines.)"""
        if self._entered:
            raise RuntimeError("a deadline is entered once")
        task = asyncio.current_task(self._loop)
        if task is None:
            raise RuntimeError("a deadline is used inside a task")
        self._entered, self._task, self._cancelling = True, task, task.cancelling()
        self.reschedule(self._when)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._exited = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._expired:
            assert self._task is not None
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc

    def _fire(self) -> None:
        self._handle = None
        self._expired = True
        assert self._task is not None
        self._task.cancel()
