"""An SSE response relayed from the upstream connection's callbacks: no task or coroutine per event.

The relay is the upstream body's sink. Each piece goes through the sans-IO `StreamGuard`, and what
the guard says to write goes out in one `transport.write` on the client's socket, from the same
callback. Flow control both ways: when the client's transport passes its high-water mark it
pauses the upstream's reading, and resumes it when the client has drained (and, after
--client-stall-timeout without draining, the client counts as stalled). One timer per stream
carries the hold window, the idle timeout and the keep-alive comments, re-armed only when it fires.

The relay decides nothing. Every ending is an event to the lifecycle (the guard's verdict, the
upstream's socket failing, a stall, shutdown, a write the client is gone for), and the lifecycle's
answer is carried out at once, from the callback, by `reply.carry_out`: the guard words a failure
both ways, and the answer takes its frame once the exchange is committed (`Lifecycle.committed`,
the only such flag: set here when the guard asks for the 200), its status before, or a cut.

The handler's coroutine wakes only when the relay needs it: to send the status line and headers
(`Need.COMMIT`; the upstream is paused meanwhile and what the guard said after is kept in order),
when the exchange is over (`DONE`: let the client take the reply in, close as the answer says), or,
with --resume-on-cut, to send a continuation (`RESUME`: the upstream broke and the guard asked to
continue; `relink` then carries on with the continuation's connection, `give_up` ends as the stream
would have without the flag), or for a bug of ours (`BUG`).

The handler's side is `relay_stream` (at the end): the status line and headers, the loop over the
relay's needs, and `reply.settle`, which lets the client take the relay's reply in.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from enum import Enum
from typing import ParamSpec, cast

from proxy.config import Config
from proxy.core.guard import Failure, Step, StreamGuard
from proxy.core.headers import response_headers
from proxy.core.lifecycle import Answer, Close, Lifecycle, Outcome, Reason, Reply
from proxy.core.record import ExchangeRecord
from proxy.exchange.client_writer import ClientGone, ClientWriter, ResponseHead
from proxy.exchange.errors import Cause, Interrupted, Interrupter, UpstreamFailure, told
from proxy.exchange.reply import carry_out, settle
from proxy.exchange.resume_io import Resuming, with_keepalives
from proxy.exchange.upstream import UpstreamHead, UpstreamLink

__all__ = ["KEEPALIVE", "Need", "StreamRelay", "count_stream", "is_stream", "relay_stream"]

KEEPALIVE = b": keep-alive\n\n"
_P = ParamSpec("_P")


class Line(Enum):
    """Where the stream's status line is: held (a failure may still be a status), due (committed:
    the handler sends it), sent (on the client's transport)."""

    HELD = "held"
    DUE = "due"
    SENT = "sent"


# As plain names for the per-read path (one lookup, not two: proxy/server/speedups.py says why it counts).
_HELD, _DUE, _SENT = Line.HELD, Line.DUE, Line.SENT


class Need(Enum):
    COMMIT = "commit"
    DONE = "done"
    RESUME = "resume"
    BUG = "bug"


def _after_the_line(answer: Answer) -> bool:
    """Whether carrying out `answer` writes into the body (a frame, its last events), after the 200."""
    return answer.reply is Reply.FRAME or (answer.reply is Reply.NOTHING and answer.close is Close.KEEP)


def count_stream(guard: StreamGuard, ex: ExchangeRecord) -> None:
    """Copy what the guard counted into the exchange's record."""
    ex.events = guard.events
    ex.content_events = guard.content_events
    ex.rewrites = list(guard.rewrites)
    ex.record_usage(guard.usage)
    ex.upstream_message = guard.upstream_message


class StreamRelay:
    __slots__ = ("_broke", "_clock", "_ending", "_final", "_guard", "_hold_until", "_idle", "_interval", "_last_heard",
                 "_last_sent", "_life", "_line", "_link", "_loop", "_out", "_paused", "_pending", "_stall",
                 "_stall_timer", "_waiter", "bug", "ex", "resume_reason", "settle")  # fmt: skip

    def __init__(
        self, link: UpstreamLink, guard: StreamGuard, life: Lifecycle, ex: ExchangeRecord, cfg: Config,
        out: ClientWriter,
    ) -> None:
        self._loop = loop = asyncio.get_running_loop()
        self._link, self._guard, self._life, self.ex = link, guard, life, ex
        self._out: ClientWriter | None = out
        self._idle, self._interval, self._stall = cfg.idle_timeout, cfg.keepalive_interval, cfg.client_stall_timeout
        now = loop.time()
        self._last_heard = self._last_sent = now
        self._hold_until = now + cfg.hold_headers
        self._line = Line.SENT if life.committed else Line.HELD
        self._pending: list[bytes] = []  # what the guard said before the status line was out
        self._ending: tuple[Answer, Failure | None] | None = None  # an ending that waits for the status line
        self._final: Need | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False  # by the client's flow control
        self._stall_timer: asyncio.TimerHandle | None = None
        self.bug: BaseException | None = None
        self.settle = False  # Need.DONE: the reply leaves the connection up, for `reply.settle`
        self._broke: Reason | None = None  # a failure of the upstream's socket, told to the lifecycle if it ends
        self.resume_reason: Reason | None = None  # Need.RESUME: why the stream broke
        if self._line is Line.SENT:
            out.on_flow(self._client_paused, self._client_drained)
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

    def interrupt(self, cause: Cause) -> None:
        """Shutdown, or the client left: the lifecycle's event, its answer carried out at once."""
        if self._final is not None:
            return
        answer = told(self._life, cause)
        if cause is Cause.CLIENT_GONE:  # (as the upstream's sink.failed: one event, carried out now)
            self._conclude(answer, b"", None)
            return
        self._run(self._guard.fail, Reason.SHUTDOWN if answer is None else answer.reason)  # the guard words it

    async def wait(self) -> Need:
        """Until the handler has something to do."""
        while True:
            if self._final is not None:
                return self._final
            if self._line is Line.DUE:
                return Need.COMMIT
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    def committed(self) -> None:
        """The status line was just handed to the transport: send what the guard said meanwhile, and
        read on (or end, if the stream ended meanwhile)."""
        out = self._out
        assert out is not None
        assert self._line is Line.DUE
        self._line = Line.SENT
        out.on_flow(self._client_paused, self._client_drained)
        pending, self._pending = self._pending, []
        data = pending[0] if len(pending) == 1 else b"".join(pending)
        if self._ending is not None:
            answer, failure = self._ending
            self._conclude(answer, data, failure)
            return
        if data and not self._write(data):
            return
        if self.resume_reason is not None:
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
        # (`_final` as declared, not narrowed to None: attaching may end the stream, and compiled code
        # would trust the narrowing at the test below)
        self._link, self._final, self._broke, self.resume_reason = link, cast("Need | None", None), None, None
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

    def give_up_for(self, cause: Cause) -> None:
        """Shutdown came (or the client left) while a continuation was awaited."""
        self._final = None
        self.interrupt(cause)

    def keepalive(self) -> bool:
        """A keep-alive comment now, while a continuation is awaited; False when the client is gone."""
        if self._line is not Line.SENT or not self._guard.keepalive_safe:
            return True
        return self._write(KEEPALIVE)

    def stop(self) -> None:
        """The exchange is over: no timer stays armed, no callback reaches the client."""
        if self._final is None:
            self._final = Need.DONE
        self._cancel_timers()
        self._out = None  # (no cycle keeps the exchange's objects alive once it is over)

    # ---- internals --------------------------------------------------------------------------------

    def _run(self, call: Callable[_P, Step], *args: _P.args, **kwargs: _P.kwargs) -> None:
        try:
            self._carry(call(*args, **kwargs))
        except Exception as exc:  # a bug of ours: the handler answers it (a 500 or an error frame)
            self.bug = exc
            self._finish(Need.BUG)

    def _carry(self, step: Step) -> None:
        if step.content_events:
            ex = self.ex
            now = time.monotonic()
            if step.first_content and ex.first_content_at is None:
                ex.first_content_at = now
            ex.note_content(now, step.content_events)
        line = self._line
        if step.commit and line is _HELD:
            self._ask()  # (before an ending in the same step: the content before it commits the 200)
            line = self._line
        if step.done:
            self._ended(step)
            return
        sent = line is _SENT
        if step.resume is not None:  # --resume-on-cut: nothing more from this upstream
            self.resume_reason = step.resume
            self._link.pause_reading()
            if sent:
                if not step.data or self._write(step.data):
                    self._finish(Need.RESUME)
                return
            # (else the status line is due first: `committed` asks for the continuation after it)
        if not sent:
            if step.commit or step.data or line is _DUE:
                self._pending.append(step.data)
                self._ask()
            return
        if step.data:
            self._write(step.data)

    def _ended(self, step: Step) -> None:
        """The guard's final step: the lifecycle's verdict on it, and its answer carried out."""
        life = self._life
        # The upstream's socket failed: its reason, its cancellation; else the guard's own verdict.
        if self._broke is not None:
            life.upstream_failed(self._broke)
        else:
            life.guard_ended(step.outcome or Outcome.ERROR, step.reason or Reason.PROXY_ERROR)
        answer = life.ended  # (this step's, or the earlier ending's: shutdown, the client gone)
        assert answer is not None
        assert answer.reply is not Reply.CUT or answer.reason is Reason.CLIENT_STALLED, answer
        if answer.reply is Reply.STATUS:  # nothing was committed: what the guard released is not sent
            self._pending = []
            self._guard.status_instead()
            self._conclude(answer, b"", step.failure)
        elif self._line is Line.SENT or not _after_the_line(answer):
            self._conclude(answer, step.data, step.failure)
        else:  # (an ending while the status line is due: it is carried out just after it)
            self._pending.append(step.data)
            self._ending = (answer, step.failure)
            self._ask()

    def _conclude(self, answer: Answer | None, data: bytes, failure: Failure | None) -> None:
        """Carry out the answer (`reply.carry_out`); the handler then settles it."""
        out = self._out
        if out is not None:
            body_end = answer is not None and answer.reply is Reply.NOTHING and answer.close is Close.KEEP
            if body_end and data and not self._write(data):
                return  # (the client left during the last write: carried out as its departure)
            try:
                self.settle = carry_out(out, answer, dialect=self._guard.dialect, frame=data, failure=failure)
            except ConnectionError:  # the client's socket closed under the status
                out.cut()
                self.settle = False
        self._finish(Need.DONE)

    def _ask(self) -> None:
        if self._line is Line.HELD:
            self._line = Line.DUE
            self._life.committed_now()  # no status can replace the 200 from here: a failure is a frame
            self._link.pause_reading()  # nothing more until the status line is out
            self._wake()

    def _write(self, data: bytes) -> bool:
        """A piece of the body to the client; False when it is gone (and that was carried out)."""
        out = self._out
        if out is None or not out.write_raw(data):
            self._conclude(self._life.client_gone(), b"", None)
            return False
        return True

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
            self._conclude(self._life.client_stalled(), b"", None)

    def _deadline(self) -> float:
        stall = self._last_heard + self._idle
        if self._line is not Line.SENT:
            return stall if self._line is Line.DUE else min(stall, self._hold_until)
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
        # Tested through a local: the calls below may end the stream, and compiled code would trust a
        # narrowing of `_final` itself at the test after them.
        final = self._final
        if final is not None:
            return
        now = self._loop.time()
        line = self._line
        if self._paused or line is Line.DUE:
            self._last_heard = now  # waiting on the client, not on the upstream
        if now >= self._last_heard + self._idle:
            self._broke = Reason.STALL_TIMEOUT
            self._run(self._guard.fail, Reason.STALL_TIMEOUT)
        elif line is not Line.SENT:
            if line is Line.HELD and now >= self._hold_until:
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


def is_stream(head: UpstreamHead) -> bool:
    """A 2xx event stream the proxy can read (one the upstream compressed anyway is copied through)."""
    encoding = head.headers.get("Content-Encoding", "identity").lower()
    return (
        200 <= head.status < 300
        and head.headers.get("Content-Type", "").startswith("text/event-stream")
        and encoding == "identity"
    )


def stream_response(head: UpstreamHead) -> ResponseHead:
    headers = response_headers(head.headers, body_rewritten=False)
    headers.popall("Content-Length", None)
    headers["Cache-Control"] = "no-cache"
    headers["X-Accel-Buffering"] = "no"
    return ResponseHead(head.status, headers, reason=head.reason or None)


async def relay_stream(
    link: UpstreamLink,
    head: UpstreamHead,
    guard: StreamGuard,
    out: ClientWriter,
    life: Lifecycle,
    ex: ExchangeRecord,
    cfg: Config,
    interrupter: Interrupter,
    resuming: Resuming | None = None,
) -> None:
    """Relay the stream until the guard or the lifecycle ends it.

    With `resuming` (--resume-on-cut), the relay's `RESUME` is carried out here, in one place: the
    continuation's connection replaces the upstream's, or the relay gives up as the stream would have
    ended without the flag.
    """
    response: ResponseHead | None = None  # the held status line, until written (not kept while the stream runs)
    if cfg.hold_headers <= 0:
        await out.commit(stream_response(head))
    else:
        response = stream_response(head)
    relay = StreamRelay(link, guard, life, ex, cfg, out)
    interrupter.watch(relay.interrupt)
    link.attach(relay)
    try:
        while True:
            need = await relay.wait()
            if need is Need.COMMIT:
                assert response is not None  # (the status line is due once)
                out.commit_now(response, hold=True)  # (the relay hears a client that stops reading: no wait)
                response = None
                relay.committed()  # the events the guard passed meanwhile carry the head, in one write
                out.flush_head()
            elif need is Need.DONE:  # the relay carried out the lifecycle's answer
                if relay.settle:
                    assert life.ended is not None
                    await settle(out, life.ended)
                return
            elif need is Need.RESUME:
                assert resuming is not None
                await _resume(relay, resuming, guard, cfg, interrupter)
            else:
                assert relay.bug is not None
                raise relay.bug
    finally:
        relay.stop()
        if not relay.link.complete:
            relay.link.pause_reading()  # nothing more reaches a finished relay (a drain that takes over resumes it)
        count_stream(guard, ex)


async def _resume(
    relay: StreamRelay, resuming: Resuming, guard: StreamGuard, cfg: Config, interrupter: Interrupter
) -> None:
    """The stream broke and the guard asked to continue: a continuation, or the end it would have had."""
    reason = relay.resume_reason
    assert reason is not None

    async def keepalive() -> bool:
        if not relay.keepalive():
            raise ClientGone("the client closed the connection")
        return True

    try:
        link = await with_keepalives(resuming.carry_on(guard, reason), keepalive, cfg.keepalive_interval)
    except Interrupted as exc:
        relay.give_up_for(exc.cause)
        interrupter.watch(relay.interrupt)
        return
    interrupter.watch(relay.interrupt)
    if link is None:
        relay.give_up()
    else:
        relay.relink(link)
