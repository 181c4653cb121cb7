"""One timer per committed stream for its idle timeout and its keep-alive comments, re-armed lazily.

A timeout around every upstream read (an `asyncio.timeout` context, a timer handle, a task
lookup) is a tenth of the proxy's CPU per event at LLM token rates, where every event is its own
read. Instead the stream loop only notes when it last heard the upstream; the one timer, armed at
the earliest deadline, checks when it fires whether the deadline still holds and re-arms itself at
the new one if the stream was heard since (once per keep-alive interval at most, whatever the
token rate). A stall poisons the upstream reader with `UpstreamStalled` (the stream is over); a
keep-alive comment is written by a short task (one whole chunk, so it cannot split an event), and a
failure of that write reaches the stream loop through the reader as `KeepaliveFailed`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp

__all__ = ["KeepaliveFailed", "StreamClock", "UpstreamStalled"]


class UpstreamStalled(Exception):
    """The upstream sent nothing for --idle-timeout seconds."""


class KeepaliveFailed(Exception):
    """Writing a keep-alive comment to the client failed; `cause` says how (stalled, or gone)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class StreamClock:
    __slots__ = ("_handle", "_idle", "_interval", "_keepalive", "_loop", "_reader", "_writing",
                 "last_heard", "last_sent")  # fmt: skip

    def __init__(
        self,
        reader: aiohttp.StreamReader,
        *,
        idle: float,
        keepalive_interval: float,
        keepalive: Callable[[], Awaitable[bool]],
        last_heard: float,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._reader = reader
        self._idle = idle
        self._interval = keepalive_interval
        self._keepalive = keepalive  # writes one comment if the stream allows it; True when written
        self._writing: asyncio.Task[None] | None = None
        self.last_heard = self.last_sent = last_heard
        self._handle: asyncio.TimerHandle | None = None
        self._arm()

    def heard(self, now: float) -> None:
        """The stream loop read from the upstream (and forwarded what it read)."""
        self.last_heard = now

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._writing is not None:
            self._writing.cancel()
            self._writing = None

    def _deadline(self) -> float:
        stall = self.last_heard + self._idle
        if self._interval:
            return min(stall, max(self.last_heard, self.last_sent) + self._interval)
        return stall

    def _arm(self) -> None:
        self._handle = self._loop.call_at(self._deadline(), self._fire)

    def _fire(self) -> None:
        now = self._loop.time()
        if now >= self.last_heard + self._idle:
            self._handle = None
            self._reader.set_exception(UpstreamStalled())
            return
        if self._interval and now >= max(self.last_heard, self.last_sent) + self._interval:
            self.last_sent = now
            if self._writing is None:
                self._writing = self._loop.create_task(self._write_keepalive())
        self._arm()  # (heard since: the deadline moved, and is re-armed only now)

    async def _write_keepalive(self) -> None:
        try:
            await self._keepalive()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the client stalled or left: the stream loop decides what that means
            self._reader.set_exception(KeepaliveFailed(exc))
        finally:
            self._writing = None
