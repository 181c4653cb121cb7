"""One exchange's fate, decided in one place: its phases, the events that move it, the verdict table.

Sans-IO, in the manner of h11's `_state.py`. The shell turns socket facts into events (the client
left, the upstream stalled, shutdown came, the stream guard finished) and carries out the `Answer`
each event returns: whether to cancel (or drain) the upstream and how to tell the client. The first
event that ends the exchange fixes its outcome and reason; every later one is ignored, so the order
in which the shell notices things can never change a verdict.

    (phase,             event)            -> reason                cancel upstream      tell the client
    (RECEIVED,          refused)          -> the event's           no                   status
    (RECEIVED,          client_gone)      -> client_disconnect     no (none engaged)    nothing
    (RECEIVED,          interrupted)      -> shutdown              no                   status
    (AWAITING_HEADERS,  upstream_failed)  -> the event's           by reason            status
    (AWAITING_HEADERS,  client_gone)      -> client_disconnect     yes, or drain        nothing
    (AWAITING_HEADERS,  interrupted)      -> shutdown              yes                  status
    (STREAMING,         guard_ended)      -> the guard's           upstream_error on an error (the guard's step says it)
    (STREAMING,         upstream_failed)  -> the event's           by reason            fail (status or frame)
    (STREAMING,         client_gone)      -> client_disconnect     yes, or drain        nothing
    (STREAMING,         client_stalled)   -> client_stalled        yes                  cut
    (STREAMING,         interrupted)      -> shutdown              yes                  fail (status or frame)
    (RESPONDING_WHOLE,  body_ended)       -> the event's           no                   nothing (already sent)
    (RESPONDING_WHOLE,  upstream_failed)  -> the event's           by reason            fail (status or cut)
    (RESPONDING_WHOLE,  client_gone)      -> client_disconnect     yes, or drain        nothing
    (RESPONDING_WHOLE,  client_stalled)   -> client_stalled        yes                  cut
    (RESPONDING_WHOLE,  interrupted)      -> shutdown              yes                  fail (status or cut)
    (any,               bug)              -> proxy_error           no                   fail

"fail" is a real HTTP status while nothing was committed; after the commit it is the dialect's error
frame for a stream and a cut connection for a whole body (HTTP/1.1 has no other way to say a plain
body broke).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.core.record import ExchangeRecord

__all__ = [
    "CANCELLATION_REASONS",
    "REASONS",
    "Answer",
    "Event",
    "Lifecycle",
    "Outcome",
    "Phase",
    "Reason",
    "Reply",
    "status_for",
]


class Phase(StrEnum):
    RECEIVED = "received"
    AWAITING_HEADERS = "awaiting_headers"
    STREAMING = "streaming"
    RESPONDING_WHOLE = "responding_whole"
    FINISHED = "finished"


class Outcome(StrEnum):
    OK = "ok"
    ERROR = "error"
    ABORTED = "aborted"


class Reason(StrEnum):
    """The `reason` label values (design section 3), fixed."""

    COMPLETE = "complete"
    UPSTREAM_4XX = "upstream_4xx"
    UPSTREAM_5XX = "upstream_5xx"
    CONNECT_FAILED = "connect_failed"
    FIRST_BYTE_TIMEOUT = "first_byte_timeout"
    STALL_TIMEOUT = "stall_timeout"
    STREAM_CUT = "stream_cut"
    STRAY_HTTP_BLOCK = "stray_http_block"
    UPSTREAM_ERROR_FRAME = "upstream_error_frame"
    INVALID_UPSTREAM_BODY = "invalid_upstream_body"
    INCOMPLETE_BATCH = "incomplete_batch"
    BODY_TOO_LARGE = "body_too_large"
    SHUTDOWN = "shutdown"
    PROXY_ERROR = "proxy_error"
    BAD_REQUEST = "bad_request"
    BAD_UPSTREAM_RESPONSE = "bad_upstream_response"
    UPSTREAM_ABORTED = "upstream_aborted"
    PROXY_OVERLOADED = "proxy_overloaded"
    CLIENT_TIMEOUT = "client_timeout"
    CLIENT_DISCONNECT = "client_disconnect"
    CLIENT_STALLED = "client_stalled"


# reason -> (outcome, the HTTP status the proxy gives it when it answers itself; 0: the upstream's own)
REASONS: MappingProxyType[Reason, tuple[Outcome, int]] = MappingProxyType({
    Reason.COMPLETE: (Outcome.OK, 0),
    Reason.UPSTREAM_4XX: (Outcome.ERROR, 0),
    Reason.UPSTREAM_5XX: (Outcome.ERROR, 0),
    Reason.CONNECT_FAILED: (Outcome.ERROR, 502),
    Reason.FIRST_BYTE_TIMEOUT: (Outcome.ERROR, 504),
    Reason.STALL_TIMEOUT: (Outcome.ERROR, 504),
    Reason.STREAM_CUT: (Outcome.ERROR, 502),
    Reason.STRAY_HTTP_BLOCK: (Outcome.ERROR, 502),
    Reason.UPSTREAM_ERROR_FRAME: (Outcome.ERROR, 502),
    Reason.INVALID_UPSTREAM_BODY: (Outcome.ERROR, 502),
    Reason.INCOMPLETE_BATCH: (Outcome.ERROR, 502),
    Reason.BODY_TOO_LARGE: (Outcome.ERROR, 413),
    Reason.SHUTDOWN: (Outcome.ERROR, 503),
    Reason.PROXY_ERROR: (Outcome.ERROR, 500),
    Reason.BAD_REQUEST: (Outcome.ERROR, 400),
    Reason.BAD_UPSTREAM_RESPONSE: (Outcome.ERROR, 502),
    Reason.UPSTREAM_ABORTED: (Outcome.ERROR, 502),
    Reason.PROXY_OVERLOADED: (Outcome.ERROR, 503),
    Reason.CLIENT_TIMEOUT: (Outcome.ERROR, 408),
    Reason.CLIENT_DISCONNECT: (Outcome.ABORTED, 0),
    Reason.CLIENT_STALLED: (Outcome.ABORTED, 0),
})

# The cancellation `reason` label values; an upstream failure the proxy reacts to by closing the
# upstream names itself, any other error the proxy ended a stream with is `upstream_error`.
CANCELLATION_REASONS = (
    "client_disconnect", "client_stalled", "stall_timeout", "first_byte_timeout", "shutdown", "upstream_error",
)
_CANCELS_AS_ITSELF = frozenset({Reason.FIRST_BYTE_TIMEOUT, Reason.STALL_TIMEOUT, Reason.SHUTDOWN})


def status_for(reason: Reason) -> int:
    """The HTTP status of a verdict the proxy answers itself (design section 10)."""
    return REASONS[reason][1] or 502


class Event(StrEnum):
    REFUSED = "refused"  # the proxy will not forward the request (a bad target, too large, too slow...)
    UPSTREAM_FAILED = "upstream_failed"  # connect, timeouts, broken HTTP, a cut or stalled body
    GUARD_ENDED = "guard_ended"  # the stream guard's final step
    BODY_ENDED = "body_ended"  # a whole body was delivered (or replaced by the judged answer)
    CLIENT_GONE = "client_gone"
    CLIENT_STALLED = "client_stalled"
    INTERRUPTED = "interrupted"  # shutdown's drain time is over
    BUG = "bug"  # the proxy's own


class Reply(StrEnum):
    NOTHING = "nothing"  # the client is gone, or already has its answer
    STATUS = "status"  # a whole HTTP error response in the dialect's shape (nothing was committed)
    FRAME = "frame"  # the stream's error frame (the stream guard writes it)
    CUT = "cut"  # abort the client connection: no second response may go into a committed body


@dataclass(frozen=True, slots=True)
class Answer:
    reason: Reason
    cancel: str | None = None  # count this cancellation and close the upstream connection
    drain: bool = False  # read the upstream to its end for its usage (--on-abandon drain), then close
    reply: Reply = Reply.NOTHING

    @property
    def status(self) -> int:
        return status_for(self.reason)


_CANCEL_BY_REASON, _CANCEL_CLIENT, _NO_CANCEL = "by_reason", "client", None
_FAIL = "fail"  # resolved to STATUS, FRAME or CUT by whether the exchange committed

# (phase, event) -> (fixed reason or None for the event's own, cancel rule, reply)
_TABLE: MappingProxyType[tuple[Phase, Event], tuple[Reason | None, str | None, str]] = MappingProxyType({
    (Phase.RECEIVED, Event.REFUSED): (None, _NO_CANCEL, Reply.STATUS),
    (Phase.RECEIVED, Event.CLIENT_GONE): (Reason.CLIENT_DISCONNECT, _NO_CANCEL, Reply.NOTHING),
    (Phase.RECEIVED, Event.INTERRUPTED): (Reason.SHUTDOWN, _NO_CANCEL, Reply.STATUS),
    (Phase.AWAITING_HEADERS, Event.UPSTREAM_FAILED): (None, _CANCEL_BY_REASON, Reply.STATUS),
    (Phase.AWAITING_HEADERS, Event.CLIENT_GONE): (Reason.CLIENT_DISCONNECT, _CANCEL_CLIENT, Reply.NOTHING),
    (Phase.AWAITING_HEADERS, Event.INTERRUPTED): (Reason.SHUTDOWN, _CANCEL_BY_REASON, Reply.STATUS),
    (Phase.STREAMING, Event.GUARD_ENDED): (None, _CANCEL_BY_REASON, Reply.NOTHING),
    (Phase.STREAMING, Event.UPSTREAM_FAILED): (None, _CANCEL_BY_REASON, _FAIL),
    (Phase.STREAMING, Event.CLIENT_GONE): (Reason.CLIENT_DISCONNECT, _CANCEL_CLIENT, Reply.NOTHING),
    (Phase.STREAMING, Event.CLIENT_STALLED): (Reason.CLIENT_STALLED, _CANCEL_CLIENT, Reply.CUT),
    (Phase.STREAMING, Event.INTERRUPTED): (Reason.SHUTDOWN, _CANCEL_BY_REASON, _FAIL),
    (Phase.RESPONDING_WHOLE, Event.BODY_ENDED): (None, _NO_CANCEL, Reply.NOTHING),
    (Phase.RESPONDING_WHOLE, Event.UPSTREAM_FAILED): (None, _CANCEL_BY_REASON, _FAIL),
    (Phase.RESPONDING_WHOLE, Event.CLIENT_GONE): (Reason.CLIENT_DISCONNECT, _CANCEL_CLIENT, Reply.NOTHING),
    (Phase.RESPONDING_WHOLE, Event.CLIENT_STALLED): (Reason.CLIENT_STALLED, _CANCEL_CLIENT, Reply.CUT),
    (Phase.RESPONDING_WHOLE, Event.INTERRUPTED): (Reason.SHUTDOWN, _CANCEL_BY_REASON, _FAIL),
})
_ENGAGED = frozenset({Phase.AWAITING_HEADERS, Phase.STREAMING, Phase.RESPONDING_WHOLE})


class Lifecycle:
    """The state machine of one exchange; it writes the verdict into the exchange's record, once."""

    __slots__ = ("_record", "committed", "drain_on_abandon", "ended", "ended_in", "phase")

    def __init__(self, record: ExchangeRecord, *, drain_on_abandon: bool = False) -> None:
        self._record = record
        self.phase = Phase.RECEIVED
        self.ended_in: Phase | None = None  # the phase the verdict was taken in
        self.ended: Answer | None = None
        self.committed = False  # the client has the status line
        self.drain_on_abandon = drain_on_abandon

    # ---- progress ---------------------------------------------------------------------------------

    def sent(self) -> None:
        """The request went upstream: from now on the upstream is engaged and may need cancelling."""
        self._advance(Phase.RECEIVED, Phase.AWAITING_HEADERS)

    def headers_received(self, *, stream: bool) -> None:
        self._advance(Phase.AWAITING_HEADERS, Phase.STREAMING if stream else Phase.RESPONDING_WHOLE)

    def committed_now(self) -> None:
        self.committed = True

    # ---- endings ----------------------------------------------------------------------------------

    def refused(self, reason: Reason) -> Answer | None:
        return self._end(Event.REFUSED, reason)

    def upstream_failed(self, reason: Reason) -> Answer | None:
        return self._end(Event.UPSTREAM_FAILED, reason)

    def guard_ended(self, outcome: str, reason: str) -> Answer | None:
        answer = self._end(Event.GUARD_ENDED, Reason(reason))
        assert answer is None or REASONS[answer.reason][0] == outcome, (outcome, reason)
        return answer

    def body_ended(self, reason: Reason) -> Answer | None:
        return self._end(Event.BODY_ENDED, reason)

    def client_gone(self) -> Answer | None:
        return self._end(Event.CLIENT_GONE, None)

    def client_stalled(self) -> Answer | None:
        return self._end(Event.CLIENT_STALLED, None)

    def interrupted(self) -> Answer | None:
        return self._end(Event.INTERRUPTED, None)

    def bug(self) -> Answer | None:
        return self._end(Event.BUG, None)

    # ---- internals --------------------------------------------------------------------------------

    def _advance(self, expected: Phase, to: Phase) -> None:
        if self.ended is not None:
            return
        if self.phase is not expected:
            raise RuntimeError(f"lifecycle: {to} from {self.phase}, expected {expected}")
        self.phase = to
        self._record.phase = str(to)

    def _end(self, event: Event, reason: Reason | None) -> Answer | None:
        """The first ending fixes the verdict; later ones return None (already decided)."""
        if self.ended is not None:
            return None
        fixed: Reason | None
        if event is Event.BUG:
            fixed, cancel_rule, reply = Reason.PROXY_ERROR, _NO_CANCEL, _FAIL
        else:
            try:
                fixed, cancel_rule, reply = _TABLE[(self.phase, event)]
            except KeyError:
                raise RuntimeError(f"lifecycle: no transition for {event} in {self.phase}") from None
        final = fixed or reason
        assert final is not None
        cancel, drain = self._cancel(cancel_rule, final)
        answer = Answer(final, cancel, drain, self._reply(reply))
        self.ended, self.ended_in = answer, self.phase
        self.phase = Phase.FINISHED
        record = self._record
        record.outcome, record.reason = str(REASONS[final][0]), str(final)
        record.upstream_cancelled = cancel
        record.drained = drain
        record.settled_at = time.monotonic()
        record.phase = str(self.ended_in)
        return answer

    def _cancel(self, rule: str | None, reason: Reason) -> tuple[str | None, bool]:
        if rule is None or self.phase not in _ENGAGED:
            return None, False
        if rule == _CANCEL_CLIENT:
            if self.drain_on_abandon and reason is Reason.CLIENT_DISCONNECT:
                return None, True
            return str(reason), False
        if reason in _CANCELS_AS_ITSELF:
            return str(reason), False
        if self.phase is Phase.STREAMING and REASONS[reason][0] is Outcome.ERROR and reason is not Reason.PROXY_ERROR:
            return "upstream_error", False  # the proxy ended the stream after an upstream failure
        return None, False

    def _reply(self, reply: str) -> Reply:
        if reply != _FAIL:
            return Reply(reply)
        if not self.committed:
            return Reply.STATUS
        return Reply.FRAME if self.phase is Phase.STREAMING else Reply.CUT
