"""An SSE response relayed from the upstream connection's callbacks: no task or coroutine per event.

The relay is the upstream body's sink. Each piece goes through the sans-IO `StreamGuard`, and what
the guard says to write goes out in one `transport.write` on the client's socket, from the same
callback. Flow control both ways: when the client's transport passes its high-water mark it
pauses the upstream's reading, and resumes it when the client has drained (and, after
--client-stall-timeout without draining, the client counts as gone). One timer per stream carries
the hold window, the idle timeout and the keep-alive comments, re-armed only when it fires.

The handler's coroutine wakes only when the relay needs it: to send the status line and headers
(`Need.COMMIT`; the upstream is paused meanwhile and what the guard said after is kept in order),
to finish the response (`END`), to send a failure as a real status (`FAILURE`), when the client
left or stalled (`GONE`, `STALLED`), or, with --resume-on-cut, to send a continuation (`RESUME`: the
upstream broke and the guard asked to continue; `relink` then carries on with the continuation's
connection, `give_up` ends as the stream would have without the flag). The verdicts are the
lifecycle's and the guard's; the relay only turns socket facts into their inputs.
"""

from __future__ import annotations

import asyncio
import time
from enum import Enum
from typing import Protocol

from proxy.config import Config
from proxy.core.guard import Failure, Step, StreamGuard
from proxy.core.lifecycle import Lifecycle, Reason, Reply
from proxy.core.record import ExchangeRecord
from proxy.exchange.failures import UpstreamFailure
from proxy.exchange.upstream import UpstreamLink

__all__ = ["KEEPALIVE", "ClientSide", "Need", "StreamRelay", "count_stream"]

KEEPALIVE = b": keep-alive\n\n"


class Need(Enum):
    COMMIT = "commit"
    END = "end"
    FAILURE = "failure"
    GONE = "gone"
    STALLED = "stalled"
    RESUME = "resume"
    BUG = "bug"


class ClientSide(Protocol):
    """The client's socket once the status line is out: raw writes, and its flow-control events."""

    def write_raw(self, data: bytes) -> bool:
        """Write `data` as the next piece of the body (framed as the response needs); False if gone."""

    def on_flow(self, paused: object, drained: object) -> None:
        """Call `paused()` when the client's buffer passes its high-water mark, `drained()` after."""


def count_stream(guard: StreamGuard, ex: ExchangeRecord) -> None:
    """Copy what the guard counted into the exchange's record."""
    ex.events = guard.events
    ex.content_events = guard.content_events
    ex.rewrites = list(guard.rewrites)
    ex.record_usage(guard.usage)
    ex.upstream_message = guard.upstream_message


class StreamRelay:
    __slots__ = ("_asked", "_broke", "_client", "_clock", "_final", "_guard", "_hold_until", "_idle",
                 "_interval", "_last_heard", "_last_sent", "_life", "_link", "_loop", "_paused", "_pending",
                 "_pending_done", "_stall", "_stall_timer", "_waiter", "bug", "ex", "failure",
                 "resume_reason")  # fmt: skip

    def __init__(
        self, link: UpstreamLink, guard: StreamGuard, life: Lifecycle, ex: ExchangeRecord, cfg: Config,
        *, client: ClientSide | None,
    ) -> None:
        self._loop = loop = asyncio.get_running_loop()
        self._link, self._guard, self._life, self.ex = link, guard, life, ex
        self._idle, self._interval, self._stall = cfg.idle_timeout, cfg.keepalive_interval, cfg.client_stall_timeout
        now = loop.time()
        self._last_heard = self._last_sent = now
        self._hold_until = now + cfg.hold_headers
        self._client = client  # set once the status line is out (the lifecycle's `committed`)
        self._asked = False  # Need.COMMIT is out; the upstream is paused until `committed`
        self._pending: list[bytes] = []
        self._pending_done = False
        self._final: Need | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False  # by the client's flow control
        self._stall_timer: asyncio.TimerHandle | None = None
        self.failure: Failure | None = None
        self.bug: BaseException | None = None
        self._broke: Reason | None = None  # a failure of the upstream's socket, told to the lifecycle if it ends
        self.resume_reason: str | None = None  # Need.RESUME: why the stream broke
        if client is not None:
            client.on_flow(self._client_paused, self._client_drained)
        self._clock: asyncio.TimerHandle | None = loop.call_at(self._deadline(), self._tick)

    # ---- BodySink: the upstream connection's callbacks ----------------------------------------------

    def body(self, data: bytes) -> None:
        if self._final is None and self.resume_reason is None:
            self._last_heard = self._loop.time()
            self._run(self._guard.feed, data)

    def end(self) -> None:
        if self._final is None and self.resume_reason is None:
            self._run(self._guard.end_of_stream)

    def failed(self, failure: UpstreamFailure) -> None:
        if self._final is None and self.resume_reason is None:  # (after a break: a continuation is due)
            self._broke = Reason.STREAM_CUT
            self._run(self._guard.fail, Reason.STREAM_CUT)

    # ---- shutdown, and the handler's side ------------------------------------------------------------

    def interrupt(self) -> None:
        if self._final is None:
            answer = self._life.interrupted()  # the guard words it: a frame after the commit, a 503 before
            self._run(self._guard.fail, Reason.SHUTDOWN if answer is None else answer.reason)

    async def wait(self) -> Need:
        """Until the handler has something to do."""
        while True:
            if self._final is not None:
                return self._final
            if self._asked and self._client is None:
                return Need.COMMIT
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    def take_pending(self) -> bytes:
        """What the guard passed before the status line: it goes out with it, in one write."""
        pending, self._pending = self._pending, []
        return pending[0] if len(pending) == 1 else b"".join(pending)

    def committed(self, client: ClientSide) -> None:
        """The status line is out: send what the guard said meanwhile, and read on."""
        self._client = client
        client.on_flow(self._client_paused, self._client_drained)
        pending, self._pending = self._pending, []
        data = pending[0] if len(pending) == 1 else b"".join(pending)
        if data:
            self._write(data)
        if self._pending_done:
            self._finish(Need.END)
        elif self.resume_reason is not None:
            self._finish(Need.RESUME)
        elif self._final is None:
            if not self._paused:
                self._link.resume_reading()
            self._rearm()

    @property
    def link(self) -> UpstreamLink:
        return self._link

    def relink(self, link: UpstreamLink) -> None:
        """Need.RESUME was answered with a continuation: its body comes next, through the same guard."""
        self._link, self._final, self._broke, self.resume_reason = link, None, None, None
        self._last_heard = self._last_sent = self._loop.time()
        link.attach(self)
        if self._paused:
            link.pause_reading()
            self._stall_timer = self._loop.call_later(self._stall, self._stalled)
        if self._final is None:
            self._rearm()

    def give_up(self) -> None:
        """Need.RESUME found no continuation: the stream ends with the failure it broke with."""
        self._final = None
        self._run(self._guard.give_up)

    def give_up_for_shutdown(self) -> None:
        """Shutdown came while a continuation was awaited: the stream ends with `shutdown`."""
        self._final = None
        answer = self._life.interrupted()  # the guard words it: a frame after the commit, a 503 before
        self._run(self._guard.fail, Reason.SHUTDOWN if answer is None else answer.reason)

    def keepalive(self) -> bool:
        """A keep-alive comment now, while a continuation is awaited; False when the client is gone."""
        client = self._client
        if client is None or not self._guard.keepalive_safe:
            return True
        if not client.write_raw(KEEPALIVE):
            return False
        self.ex.bytes_out += len(KEEPALIVE)
        return True

    def stop(self) -> None:
        """The exchange is over: no timer stays armed, no callback reaches the client."""
        if self._final is None:
            self._final = Need.GONE
        self._cancel_timers()
        self._client = None  # (no cycle keeps the exchange's objects alive once it is over)

    # ---- internals --------------------------------------------------------------------------------

    def _run(self, call: object, *args: object) -> None:
        try:
            step: Step = call(*args)  # type: ignore[operator]
            self._carry(step)
        except Exception as exc:  # a bug of ours: the handler answers it (a 500 or an error frame)
            self.bug = exc
            self._finish(Need.BUG)

    def _carry(self, step: Step) -> None:
        ex, life = self.ex, self._life
        if step.content_events:
            now = time.monotonic()
            if step.first_content and ex.first_content_at is None:
                ex.first_content_at = now
            ex.note_content(now, step.content_events)
        if step.done:
            # The upstream's socket failed: its reason, its cancellation; else the guard's own verdict.
            # Either way the guard's step is the reply (a frame after the commit, a status before, or
            # nothing more), carried out below.
            if self._broke is not None:
                ended = life.upstream_failed(self._broke)
            else:
                ended = life.guard_ended(step.outcome or "error", step.reason or Reason.PROXY_ERROR)
            assert ended is None or ended.reply is not Reply.CUT, ended  # (a stream is never cut for its upstream)
        if step.resume is not None:  # --resume-on-cut: nothing more from this upstream
            self.resume_reason = step.resume
            self._link.pause_reading()
            if self._client is not None:
                if step.data:
                    self._write(step.data)
                self._finish(Need.RESUME)
                return
            # (else the status line is due first: `committed` asks for the continuation after it)
        if self._client is None:
            if step.failure is not None and not self._asked:
                self.failure = step.failure
                self._finish(Need.FAILURE)
                return
            if step.commit or step.data or step.done or self._asked:
                self._pending.append(step.data)
                self._pending_done = self._pending_done or step.done
                if not self._asked:
                    self._asked = True
                    self._link.pause_reading()  # nothing more until the status line is out
                    self._wake()
            return
        if step.data:
            self._write(step.data)
        if step.done:
            self._finish(Need.END)

    def _write(self, data: bytes) -> None:
        client = self._client
        if client is None or not client.write_raw(data):
            self._finish(Need.GONE)
            return
        self.ex.bytes_out += len(data)

    def _client_paused(self) -> None:
        if self._final is None and not self._paused:
            self._paused = True
            self._link.pause_reading()
            self._stall_timer = self._loop.call_later(self._stall, self._stalled)

    def _client_drained(self) -> None:
        if self._paused:
            self._paused = False
            if self._stall_timer is not None:
                self._stall_timer.cancel()
                self._stall_timer = None
            if self._final is None:
                self._last_heard = self._loop.time()  # the upstream was not read meanwhile: not its silence
                self._link.resume_reading()

    def _stalled(self) -> None:
        self._stall_timer = None
        if self._final is None:
            self._finish(Need.STALLED)

    def _deadline(self) -> float:
        stall = self._last_heard + self._idle
        if self._client is None:
            return stall if self._asked else min(stall, self._hold_until)
        if self._interval:
            return min(stall, max(self._last_heard, self._last_sent) + self._interval)
        return stall

    def _rearm(self) -> None:
        if self._clock is not None:
            self._clock.cancel()
        self._clock = self._loop.call_at(self._deadline(), self._tick)

    def _tick(self) -> None:
        """The one timer: a stall, the end of the hold window, or a keep-alive comment is due."""
        self._clock = None
        if self._final is not None:
            return
        now = self._loop.time()
        if self._paused or (self._asked and self._client is None):
            self._last_heard = now  # waiting on the client, not on the upstream
        if now >= self._last_heard + self._idle:
            self._broke = Reason.STALL_TIMEOUT
            self._run(self._guard.fail, Reason.STALL_TIMEOUT)
        elif self._client is None:
            if not self._asked and now >= self._hold_until:
                self._run(self._guard.commit)
        elif self._interval and now >= max(self._last_heard, self._last_sent) + self._interval:
            self._last_sent = now
            if self._guard.keepalive_safe:
                self._write(KEEPALIVE)
        if self._final is None:
            self._clock = self._loop.call_at(self._deadline(), self._tick)

    def _finish(self, need: Need) -> None:
        if self._final is not None:
            return
        self._final = need
        self._cancel_timers()
        self._wake()

    def _cancel_timers(self) -> None:
        for timer in (self._clock, self._stall_timer):
            if timer is not None:
                timer.cancel()
        self._clock = self._stall_timer = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
