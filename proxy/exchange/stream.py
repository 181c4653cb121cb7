"""An SSE response relayed from the upstream connection's callbacks: no task or coroutine per event.

The relay is the upstream body's sink and a state machine of its own (`RelayState`, every move in
`_NEXT`, made by `_to`). Each piece goes through the sans-IO `StreamGuard`, and what the guard says
to write goes out in one `transport.write` on the client's socket, from the same callback: the
status line too, in the callback where the guard asks for it (HOLDING -> FLOWING), with the events
it released. Flow control both ways: when the client's transport passes its high-water mark it
pauses the upstream's reading, and resumes it when the client has drained (and, after
--client-stall-timeout without draining, the client counts as stalled). One timer per stream
carries the hold window, the idle timeout and the keep-alive comments, re-armed only when it fires.

The relay decides nothing. Every ending is an event to the lifecycle (the guard's verdict, which
words the upstream's socket failing and a stall too; the client gone or stalled; shutdown), and the
lifecycle's answer is carried out at once, from the callback, by `reply.carry_out`: the guard words
a failure both ways, and the answer takes its frame once the exchange is committed
(`Lifecycle.committed`, the only such flag: set by the writer when the status line is handed to the
transport), its status before, or a cut.

The handler's coroutine wakes only when the relay leaves the reading states: SETTLING (let the
client take the reply in, close as the answer says), ENDED (nothing to do; a bug of ours is raised
in it), or, with --resume-on-cut, RESUMING (the upstream broke and the guard asked to continue:
`relink` then carries on with the continuation's connection, `give_up` ends as the stream would
have without the flag). That side is `relay_stream` (at the end).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from enum import IntEnum
from typing import Final, ParamSpec

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

__all__ = [
    "ENDED", "FLOWING", "HOLDING", "KEEPALIVE", "RESUMING", "SETTLING", "RelayState", "StreamRelay", "count_stream",
    "is_stream", "relay_stream",
]

KEEPALIVE = b": keep-alive\n\n"
_P = ParamSpec("_P")


class RelayState(IntEnum):
    """Where a relayed stream stands; every move is in `_NEXT`, made by `StreamRelay._to`.

    HOLDING: the status line is held while the guard holds the first events (a failure may still be
    a real status), under the hold window. FLOWING: the status line is out (written from the callback
    in which the guard asked for it) and what the guard passes goes straight to the client.
    RESUMING (--resume-on-cut): the upstream broke and the handler's task looks for a continuation;
    nothing is read. SETTLING: the lifecycle's answer was carried out and the connection is up: the
    handler lets the client take it in (`reply.settle`). ENDED (final): nothing more, because the
    answer dropped the connection, a bug of ours was handed to the handler, or the handler stopped
    the relay.
    """

    HOLDING = 0
    FLOWING = 1
    RESUMING = 2
    SETTLING = 3
    ENDED = 4


HOLDING: Final = RelayState.HOLDING
FLOWING: Final = RelayState.FLOWING
RESUMING: Final = RelayState.RESUMING
SETTLING: Final = RelayState.SETTLING
ENDED: Final = RelayState.ENDED

_NEXT: Final[dict[RelayState, frozenset[RelayState]]] = {
    HOLDING: frozenset({FLOWING, SETTLING, ENDED}),
    FLOWING: frozenset({RESUMING, SETTLING, ENDED}),
    RESUMING: frozenset({FLOWING, SETTLING, ENDED}),
    SETTLING: frozenset({ENDED}),
    ENDED: frozenset(),
}


def count_stream(guard: StreamGuard, ex: ExchangeRecord) -> None:
    """Copy what the guard counted into the exchange's record."""
    ex.events = guard.events
    ex.content_events = guard.content_events
    ex.rewrites = list(guard.rewrites)
    ex.record_usage(guard.usage)
    ex.upstream_message = guard.upstream_message


class StreamRelay:
    __slots__ = ("_cfg", "_clock", "_due", "_guard", "_last_heard", "_life", "_link", "_loop", "_out", "_response",
                 "_stall_timer", "_state", "_waiter", "ex")  # fmt: skip

    def __init__(
        self, link: UpstreamLink, guard: StreamGuard, life: Lifecycle, ex: ExchangeRecord, cfg: Config,
        out: ClientWriter, response: ResponseHead | None,
    ) -> None:
        """`response`: the status line to hold until the guard asks for it; None when it is out already."""
        self._loop = loop = asyncio.get_running_loop()
        self._link, self._guard, self._life, self.ex, self._cfg = link, guard, life, ex, cfg
        self._out: ClientWriter | None = out
        self._response = response
        self._state = HOLDING if response is not None else FLOWING
        self._last_heard = now = loop.time()  # the upstream's last read (its silence is the idle timeout)
        # When the client is next due to hear from the relay: the hold window's end while HOLDING, then
        # the next keep-alive comment (when the upstream is quiet as long).
        self._due = now + cfg.hold_headers if response is not None else self._keepalive_after(now)
        self._waiter: asyncio.Future[None] = loop.create_future()  # the handler's, set when it has to act
        self._stall_timer: asyncio.TimerHandle | None = None  # armed while the client does not read
        if response is None:
            out.on_flow(self._client_paused, self._client_drained)
        self._clock: asyncio.TimerHandle | None = loop.call_at(self._deadline(), self._tick)

    @property
    def state(self) -> RelayState:
        return self._state

    @property
    def link(self) -> UpstreamLink:
        return self._link

    # ---- BodySink: the upstream connection's callbacks ----------------------------------------------

    def body(self, data: bytes) -> None:
        state = self._state
        if state is FLOWING or state is HOLDING:
            self._last_heard = self._loop.time()
            try:  # (the read's own road, not `_run`'s: a call through `*args` costs more than the read)
                self._carry(self._guard.feed(data))
            except Exception as exc:
                self._bug(exc)

    def end(self) -> None:
        if self._reading():
            self._run(self._guard.end_of_stream)

    def failed(self, failure: UpstreamFailure) -> None:
        if self._reading():  # (not while RESUMING: the broken upstream's last word is heard already)
            self._run(self._guard.fail, Reason.STREAM_CUT)

    # ---- shutdown, and the handler's side ------------------------------------------------------------

    def interrupt(self, cause: Cause) -> None:
        """Shutdown, or the client left: the lifecycle's event, its answer carried out at once."""
        if self._reading():
            self._interrupt(cause)

    async def wait(self) -> RelayState:
        """Until the handler has something to do: RESUMING, SETTLING or ENDED (a bug of ours raises)."""
        await self._waiter
        state = self._state
        if state is RESUMING:
            self._waiter = self._loop.create_future()  # (for the continuation's ending)
        return state

    def relink(self, link: UpstreamLink) -> None:
        """RESUMING was answered with a continuation: its body comes next, through the same guard."""
        self._link = link
        self._last_heard = now = self._loop.time()
        self._due = self._keepalive_after(now)
        self._to(FLOWING)
        link.attach(self)  # (may end the stream at once)
        if self._reading():
            out = self._out
            if out is not None and out.paused:
                self._client_paused()
            self._clock = self._loop.call_at(self._deadline(), self._tick)

    def give_up(self) -> None:
        """RESUMING found no continuation: the stream ends with the failure it broke with."""
        self._run(self._guard.give_up)

    def give_up_for(self, cause: Cause) -> None:
        """Shutdown came (or the client left) while a continuation was awaited."""
        if self._state is RESUMING:
            self._interrupt(cause)

    def keepalive(self) -> bool:
        """A keep-alive comment now, while a continuation is awaited; False when the client is gone."""
        if self._state is HOLDING or not self._guard.keepalive_safe:
            return True
        return self._write(KEEPALIVE)

    def stop(self) -> None:
        """The exchange is over: no timer stays armed, no callback reaches the client."""
        self._to(ENDED)
        self._out = None  # (no cycle keeps the exchange's objects alive once it is over)
        waiter = self._waiter
        if waiter.done() and not waiter.cancelled():
            waiter.exception()  # (retrieved: a bug set while the handler ended for another cause)

    # ---- the state --------------------------------------------------------------------------------

    def _to(self, state: RelayState) -> None:
        """The one place the state moves. Out of the reading states the timers are disarmed and the
        handler is woken; ENDED is final."""
        current = self._state
        if current is ENDED or state is current:
            return
        assert state in _NEXT[current], f"{current.name} -> {state.name}"
        self._state = state
        if state is not FLOWING:
            self._cancel_timers()
            waiter = self._waiter
            if not waiter.done():
                waiter.set_result(None)

    def _reading(self) -> bool:
        """HOLDING or FLOWING: the upstream is read and the timers run (a call: compiled code would
        trust a narrowing of `_state` itself across the calls that move it)."""
        state = self._state
        return state is FLOWING or state is HOLDING

    # ---- internals --------------------------------------------------------------------------------

    def _run(self, call: Callable[_P, Step], *args: _P.args, **kwargs: _P.kwargs) -> None:
        try:
            self._carry(call(*args, **kwargs))
        except Exception as exc:
            self._bug(exc)

    def _bug(self, exc: Exception) -> None:
        """A bug of ours: raised in the handler's `wait`, which answers it (a 500 or an error frame)."""
        waiter = self._waiter
        if not waiter.done():
            waiter.set_exception(exc)
            self._to(ENDED)

    def _carry(self, step: Step) -> None:
        if step.content_events:
            ex = self.ex
            now = time.monotonic()
            if step.first_content and ex.first_content_at is None:
                ex.first_content_at = now
            ex.note_content(now, step.content_events)
        if self._state is HOLDING and (step.commit or step.data):
            self._commit(step)  # (before an ending in the same step: the content before it commits the 200)
        if step.done:
            self._ended(step)
        elif step.data and not self._write(step.data):
            return
        elif step.resume is not None:  # --resume-on-cut: nothing more from this upstream
            self._link.pause_reading()
            self._to(RESUMING)

    def _commit(self, step: Step) -> None:
        """The guard asked for the 200: the status line goes out now, with the events it released in
        the same write (or alone, when it released none and the stream goes on)."""
        out, response = self._out, self._response
        assert out is not None
        assert response is not None
        self._response = None
        out.commit_now(response, hold=True)  # the exchange is committed: a failure is a frame from here
        self._due = self._keepalive_after(self._loop.time())
        self._to(FLOWING)
        out.on_flow(self._client_paused, self._client_drained)
        if not step.data and not step.done:
            out.flush_head()

    def _ended(self, step: Step) -> None:
        """The guard's final step: the lifecycle's verdict on it, and its answer carried out."""
        life = self._life
        life.guard_ended(step.outcome or Outcome.ERROR, step.reason or Reason.PROXY_ERROR)
        answer = life.ended  # (this step's, or the earlier ending's: shutdown, the client gone)
        assert answer is not None
        assert answer.reply is not Reply.CUT or answer.reason is Reason.CLIENT_STALLED, answer
        if answer.reply is Reply.STATUS:  # nothing was committed: what the guard released is not sent
            self._guard.status_instead()
            self._conclude(answer, b"", step.failure)
        else:
            self._conclude(answer, step.data, step.failure)

    def _interrupt(self, cause: Cause) -> None:
        answer = told(self._life, cause)
        if cause is Cause.CLIENT_GONE:  # (as the upstream's sink.failed: one event, carried out now)
            self._conclude(answer, b"", None)
        else:
            self._run(self._guard.fail, Reason.SHUTDOWN if answer is None else answer.reason)  # the guard words it

    def _conclude(self, answer: Answer | None, data: bytes, failure: Failure | None) -> None:
        """Carry out the answer (`reply.carry_out`): SETTLING when the connection stays up for it."""
        out = self._out
        settle = False
        if out is not None:
            body_end = answer is not None and answer.reply is Reply.NOTHING and answer.close is Close.KEEP
            if body_end and data and not self._write(data):
                return  # (the client left during the last write: carried out as its departure)
            try:
                settle = carry_out(out, answer, dialect=self._guard.dialect, frame=data, failure=failure)
            except ConnectionError:  # the client's socket closed under the status
                out.cut()
        self._to(SETTLING if settle else ENDED)

    def _write(self, data: bytes) -> bool:
        """A piece of the body to the client; False when it is gone (and that was carried out)."""
        out = self._out
        if out is None or not out.write_raw(data):
            self._conclude(self._life.client_gone(), b"", None)
            return False
        return True

    def _client_paused(self) -> None:
        if self._stall_timer is None and self._state is FLOWING:
            self._link.pause_reading()
            self._stall_timer = self._loop.call_later(self._cfg.client_stall_timeout, self._stalled)

    def _client_drained(self) -> None:
        timer = self._stall_timer
        if timer is not None:
            timer.cancel()
            self._stall_timer = None
            if self._state is FLOWING:
                self._last_heard = self._loop.time()  # the upstream was not read meanwhile: not its silence
                self._link.resume_reading()

    def _stalled(self) -> None:
        self._stall_timer = None
        if self._state is FLOWING:
            self._conclude(self._life.client_stalled(), b"", None)

    def _keepalive_after(self, now: float) -> float:
        interval = self._cfg.keepalive_interval
        return now + interval if interval else math.inf

    def _deadline(self) -> float:
        cfg = self._cfg
        stall = self._last_heard + cfg.idle_timeout
        if self._state is HOLDING:
            return min(stall, self._due)
        return min(stall, max(self._last_heard + cfg.keepalive_interval, self._due))

    def _tick(self) -> None:
        """The one timer: a stall, the end of the hold window, or a keep-alive comment is due."""
        self._clock = None
        state = self._state
        if state is not FLOWING and state is not HOLDING:
            return
        now = self._loop.time()
        cfg = self._cfg
        if self._stall_timer is not None:
            self._last_heard = now  # waiting on the client, not on the upstream
        if now >= self._last_heard + cfg.idle_timeout:
            self._run(self._guard.fail, Reason.STALL_TIMEOUT)
        elif state is HOLDING:
            if now >= self._due:
                self._run(self._guard.commit)
        elif now >= max(self._last_heard + cfg.keepalive_interval, self._due):
            self._due = self._keepalive_after(now)
            if self._guard.keepalive_safe:
                self._write(KEEPALIVE)
        if self._reading():
            self._clock = self._loop.call_at(self._deadline(), self._tick)

    def _cancel_timers(self) -> None:
        for timer in (self._clock, self._stall_timer):
            if timer is not None:
                timer.cancel()
        self._clock = self._stall_timer = None


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

    With `resuming` (--resume-on-cut), the relay's RESUMING is carried out here, in one place: the
    continuation's connection replaces the upstream's, or the relay gives up as the stream would have
    ended without the flag.
    """
    response = stream_response(head)
    if cfg.hold_headers <= 0:
        await out.commit(response)
    relay = StreamRelay(link, guard, life, ex, cfg, out, None if life.committed else response)
    interrupter.watch(relay.interrupt)
    link.attach(relay)
    try:
        state = await relay.wait()
        while state is RESUMING:
            assert resuming is not None
            await _resume(relay, resuming, guard, cfg, interrupter)
            state = await relay.wait()
        if state is SETTLING:  # the relay carried out the lifecycle's answer
            assert life.ended is not None
            await settle(out, life.ended)
    finally:
        relay.stop()
        if not relay.link.complete:
            relay.link.pause_reading()  # nothing more reaches a finished relay (a drain that takes over resumes it)
        count_stream(guard, ex)


async def _resume(
    relay: StreamRelay, resuming: Resuming, guard: StreamGuard, cfg: Config, interrupter: Interrupter
) -> None:
    """The stream broke and the guard asked to continue: a continuation, or the end it would have had."""
    reason = guard.broke_with
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
