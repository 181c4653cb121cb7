"""The exchange lifecycle, one (phase, event) pair per case, read against the table in its docstring."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from proxy.core.body import judge_body
from proxy.core.dialects import DIALECTS, RequestInfo
from proxy.core.guard import StreamGuard
from proxy.core.lifecycle import (
    REASONS,
    Answer,
    Cancellation,
    Close,
    Event,
    Lifecycle,
    Outcome,
    Phase,
    Reason,
    Reply,
    reason_for_status,
)
from proxy.core.record import ExchangeRecord

R = Reason


def _at(phase: Phase, *, committed: bool = False, drain: bool = False) -> tuple[Lifecycle, ExchangeRecord]:
    ex = ExchangeRecord("r", "POST", "/v1/chat/completions", "chat_completions", None)
    life = Lifecycle(ex, drain_on_abandon=drain)
    if phase is not Phase.RECEIVED:
        life.sent()
    if phase is Phase.STREAMING:
        life.headers_received(stream=True)
    elif phase is Phase.RESPONDING_WHOLE:
        life.headers_received(stream=False)
    if committed:
        life.committed_now()
    return life, ex


def _fire(life: Lifecycle, event: Event, reason: Reason | None) -> Answer | None:
    calls: dict[Event, Callable[[], Answer | None]] = {
        Event.REFUSED: lambda: life.refused(reason or R.BAD_REQUEST),
        Event.UPSTREAM_FAILED: lambda: life.upstream_failed(reason or R.STREAM_CUT),
        Event.GUARD_ENDED: lambda: life.guard_ended(REASONS[reason or R.COMPLETE][0], reason or R.COMPLETE),
        Event.BODY_ENDED: lambda: life.body_ended(reason or R.COMPLETE),
        Event.CLIENT_GONE: life.client_gone,
        Event.CLIENT_STALLED: life.client_stalled,
        Event.INTERRUPTED: life.interrupted,
        Event.BUG: life.bug,
    }
    return calls[event]()


# (phase, event, the event's reason, committed) -> (reason, outcome, cancel, reply)
CASES = [
    (Phase.RECEIVED, Event.REFUSED, R.BODY_TOO_LARGE, False, R.BODY_TOO_LARGE, "error", None, Reply.STATUS),
    (Phase.RECEIVED, Event.REFUSED, R.CLIENT_TIMEOUT, False, R.CLIENT_TIMEOUT, "error", None, Reply.STATUS),
    (Phase.RECEIVED, Event.REFUSED, R.PROXY_OVERLOADED, False, R.PROXY_OVERLOADED, "error", None, Reply.STATUS),
    (Phase.RECEIVED, Event.CLIENT_GONE, None, False, R.CLIENT_DISCONNECT, "aborted", None, Reply.NOTHING),
    (Phase.RECEIVED, Event.INTERRUPTED, None, False, R.SHUTDOWN, "error", None, Reply.STATUS),
    (Phase.RECEIVED, Event.BUG, None, False, R.PROXY_ERROR, "error", None, Reply.STATUS),
    (Phase.AWAITING_HEADERS, Event.UPSTREAM_FAILED, R.CONNECT_FAILED, False, R.CONNECT_FAILED, "error", None,
     Reply.STATUS),
    (Phase.AWAITING_HEADERS, Event.UPSTREAM_FAILED, R.FIRST_BYTE_TIMEOUT, False, R.FIRST_BYTE_TIMEOUT, "error",
     "first_byte_timeout", Reply.STATUS),
    (Phase.AWAITING_HEADERS, Event.UPSTREAM_FAILED, R.BAD_UPSTREAM_RESPONSE, False, R.BAD_UPSTREAM_RESPONSE, "error",
     None, Reply.STATUS),
    (Phase.AWAITING_HEADERS, Event.CLIENT_GONE, None, False, R.CLIENT_DISCONNECT, "aborted", "client_disconnect",
     Reply.NOTHING),
    (Phase.AWAITING_HEADERS, Event.INTERRUPTED, None, False, R.SHUTDOWN, "error", "shutdown", Reply.STATUS),
    (Phase.AWAITING_HEADERS, Event.BUG, None, False, R.PROXY_ERROR, "error", None, Reply.STATUS),
    (Phase.STREAMING, Event.GUARD_ENDED, R.COMPLETE, True, R.COMPLETE, "ok", None, Reply.NOTHING),
    (Phase.STREAMING, Event.GUARD_ENDED, R.STRAY_HTTP_BLOCK, True, R.STRAY_HTTP_BLOCK, "error", "upstream_error",
     Reply.FRAME),
    (Phase.STREAMING, Event.GUARD_ENDED, R.UPSTREAM_ABORTED, False, R.UPSTREAM_ABORTED, "error", "upstream_error",
     Reply.STATUS),
    (Phase.STREAMING, Event.UPSTREAM_FAILED, R.STALL_TIMEOUT, True, R.STALL_TIMEOUT, "error", "stall_timeout",
     Reply.FRAME),
    (Phase.STREAMING, Event.UPSTREAM_FAILED, R.STALL_TIMEOUT, False, R.STALL_TIMEOUT, "error", "stall_timeout",
     Reply.STATUS),
    (Phase.STREAMING, Event.UPSTREAM_FAILED, R.STREAM_CUT, True, R.STREAM_CUT, "error", "upstream_error", Reply.FRAME),
    (Phase.STREAMING, Event.CLIENT_GONE, None, True, R.CLIENT_DISCONNECT, "aborted", "client_disconnect",
     Reply.NOTHING),
    (Phase.STREAMING, Event.CLIENT_STALLED, None, True, R.CLIENT_STALLED, "aborted", "client_stalled", Reply.CUT),
    (Phase.STREAMING, Event.INTERRUPTED, None, True, R.SHUTDOWN, "error", "shutdown", Reply.FRAME),
    (Phase.STREAMING, Event.INTERRUPTED, None, False, R.SHUTDOWN, "error", "shutdown", Reply.STATUS),
    (Phase.STREAMING, Event.BUG, None, True, R.PROXY_ERROR, "error", None, Reply.FRAME),
    (Phase.RESPONDING_WHOLE, Event.BODY_ENDED, R.COMPLETE, True, R.COMPLETE, "ok", None, Reply.NOTHING),
    (Phase.RESPONDING_WHOLE, Event.BODY_ENDED, R.UPSTREAM_5XX, True, R.UPSTREAM_5XX, "error", None, Reply.NOTHING),
    (Phase.RESPONDING_WHOLE, Event.BODY_ENDED, R.INVALID_UPSTREAM_BODY, False, R.INVALID_UPSTREAM_BODY, "error", None,
     Reply.NOTHING),
    # bug 2: a whole body that stalls is stall_timeout (504, cancelled), before the commit and after it
    (Phase.RESPONDING_WHOLE, Event.UPSTREAM_FAILED, R.STALL_TIMEOUT, False, R.STALL_TIMEOUT, "error",
     "stall_timeout", Reply.STATUS),
    (Phase.RESPONDING_WHOLE, Event.UPSTREAM_FAILED, R.STALL_TIMEOUT, True, R.STALL_TIMEOUT, "error",
     "stall_timeout", Reply.CUT),
    (Phase.RESPONDING_WHOLE, Event.UPSTREAM_FAILED, R.STREAM_CUT, True, R.STREAM_CUT, "error", None, Reply.CUT),
    (Phase.RESPONDING_WHOLE, Event.CLIENT_GONE, None, True, R.CLIENT_DISCONNECT, "aborted", "client_disconnect",
     Reply.NOTHING),
    (Phase.RESPONDING_WHOLE, Event.CLIENT_STALLED, None, True, R.CLIENT_STALLED, "aborted", "client_stalled",
     Reply.CUT),
    # bug 1: shutdown reaching a committed whole body is error/shutdown, counted once, the client cut
    (Phase.RESPONDING_WHOLE, Event.INTERRUPTED, None, True, R.SHUTDOWN, "error", "shutdown", Reply.CUT),
    (Phase.RESPONDING_WHOLE, Event.INTERRUPTED, None, False, R.SHUTDOWN, "error", "shutdown", Reply.STATUS),
    (Phase.RESPONDING_WHOLE, Event.BUG, None, True, R.PROXY_ERROR, "error", None, Reply.CUT),
]


@pytest.mark.parametrize(
    ("phase", "event", "given", "committed", "reason", "outcome", "cancel", "reply"),
    CASES,
    ids=[f"{c[0]}-{c[1]}-{c[2] or ''}-{'committed' if c[3] else 'held'}" for c in CASES],
)
def test_transition(
    phase: Phase, event: Event, given: Reason | None, committed: bool,
    reason: Reason, outcome: str, cancel: str | None, reply: Reply,
) -> None:
    life, ex = _at(phase, committed=committed)
    answer = _fire(life, event, given)
    assert answer is not None
    assert (answer.reason, answer.cancel, answer.drain, answer.reply) == (reason, cancel, False, reply)
    assert (ex.outcome, ex.reason, ex.upstream_cancelled, ex.phase) == (outcome, reason, cancel, phase)
    assert life.phase is Phase.FINISHED
    assert life.ended_in is phase


CLOSES = [
    (Phase.RECEIVED, Event.REFUSED, R.BODY_TOO_LARGE, Close.AFTER),  # (its body is read out first)
    (Phase.RECEIVED, Event.REFUSED, R.BAD_REQUEST, Close.AFTER),
    (Phase.RECEIVED, Event.REFUSED, R.CLIENT_TIMEOUT, Close.NOW),  # as nginx: no lingering read of a slow body
    (Phase.RECEIVED, Event.REFUSED, R.SHUTDOWN, Close.NOW),
    (Phase.RECEIVED, Event.INTERRUPTED, None, Close.NOW),
    (Phase.RECEIVED, Event.CLIENT_GONE, None, Close.NOW),
    (Phase.AWAITING_HEADERS, Event.UPSTREAM_FAILED, R.CONNECT_FAILED, Close.KEEP),
    (Phase.AWAITING_HEADERS, Event.INTERRUPTED, None, Close.NOW),
    (Phase.STREAMING, Event.GUARD_ENDED, R.COMPLETE, Close.KEEP),
    (Phase.STREAMING, Event.UPSTREAM_FAILED, R.STREAM_CUT, Close.KEEP),
    (Phase.STREAMING, Event.CLIENT_STALLED, None, Close.NOW),
    (Phase.STREAMING, Event.INTERRUPTED, None, Close.NOW),
    (Phase.RESPONDING_WHOLE, Event.BODY_ENDED, R.COMPLETE, Close.KEEP),
    (Phase.RESPONDING_WHOLE, Event.CLIENT_GONE, None, Close.NOW),
    (Phase.STREAMING, Event.BUG, None, Close.KEEP),
]


@pytest.mark.parametrize(("phase", "event", "given", "close"), CLOSES)
def test_the_close_of_the_connection_is_the_tables(
    phase: Phase, event: Event, given: Reason | None, close: Close
) -> None:
    life, _ = _at(phase, committed=phase is not Phase.RECEIVED)
    answer = _fire(life, event, given)
    assert answer is not None
    assert answer.close is close


def test_every_pair_of_the_table_is_tested() -> None:
    from proxy.core.lifecycle import _TABLE

    tested = {(c[0], c[1]) for c in CASES}
    assert set(_TABLE) <= tested
    assert {phase for phase in Phase if phase is not Phase.FINISHED} <= {c[0] for c in CASES if c[1] is Event.BUG}


@pytest.mark.parametrize("phase", [Phase.AWAITING_HEADERS, Phase.STREAMING, Phase.RESPONDING_WHOLE])
def test_a_departed_client_is_drained_not_cancelled_with_on_abandon_drain(phase: Phase) -> None:
    life, ex = _at(phase, drain=True)
    assert life.client_gone() == Answer(R.CLIENT_DISCONNECT, None, True, Reply.NOTHING, close=Close.NOW)
    assert (ex.outcome, ex.drained, ex.upstream_cancelled) == ("aborted", True, None)


def test_a_stalled_client_is_cancelled_even_with_on_abandon_drain() -> None:
    life, _ = _at(Phase.STREAMING, drain=True)
    answer = life.client_stalled()
    assert answer is not None
    assert (answer.cancel, answer.drain) == ("client_stalled", False)


@pytest.mark.parametrize(
    "later", [Event.CLIENT_GONE, Event.CLIENT_STALLED, Event.INTERRUPTED, Event.BUG, Event.UPSTREAM_FAILED]
)
def test_the_first_ending_stands(later: Event) -> None:
    life, ex = _at(Phase.STREAMING, committed=True)
    assert life.guard_ended(Outcome.OK, Reason.COMPLETE) is not None
    assert _fire(life, later, R.STREAM_CUT) is None
    assert (ex.outcome, ex.reason, ex.upstream_cancelled) == ("ok", "complete", None)


def test_an_event_the_phase_does_not_have_is_a_bug_of_the_shell() -> None:
    life, _ = _at(Phase.RECEIVED)
    with pytest.raises(RuntimeError, match="no transition"):
        life.body_ended(R.COMPLETE)
    life, _ = _at(Phase.STREAMING)
    with pytest.raises(RuntimeError, match="expected"):
        life.sent()


def test_every_reason_has_an_outcome_and_a_status_where_the_proxy_answers() -> None:
    assert set(REASONS) == set(Reason)
    for reason, (outcome, status) in REASONS.items():
        assert isinstance(outcome, Outcome)
        if outcome is Outcome.ERROR and reason not in (R.UPSTREAM_4XX, R.UPSTREAM_5XX):
            assert 400 <= status <= 599, reason


def test_the_guard_verdicts_are_all_known_reasons() -> None:
    guard = StreamGuard(DIALECTS["chat_completions"], hold=False)
    step = guard.fail(Reason.STALL_TIMEOUT)
    life, _ = _at(Phase.STREAMING, committed=True)
    assert step.outcome is not None
    assert step.reason is not None
    assert life.guard_ended(step.outcome, step.reason) == Answer(
        R.STALL_TIMEOUT, Cancellation.STALL_TIMEOUT, False, Reply.FRAME
    )


@pytest.mark.parametrize(("status", "expected"), [(0, 400), (405, 405), (431, 431), (505, 505)])
def test_a_refusal_answers_with_its_own_status_where_the_reason_has_several(status: int, expected: int) -> None:
    life, ex = _at(Phase.RECEIVED)
    answer = life.refused(R.BAD_REQUEST, status)
    assert answer is not None
    assert (answer.reply, answer.status, answer.reason) == (Reply.STATUS, expected, R.BAD_REQUEST)
    assert (ex.outcome, ex.reason) == ("error", "bad_request")


@pytest.mark.parametrize(("status", "reason"), [
    (200, Reason.COMPLETE), (304, Reason.COMPLETE), (400, Reason.UPSTREAM_4XX), (429, Reason.UPSTREAM_4XX),
    (499, Reason.UPSTREAM_4XX), (500, Reason.UPSTREAM_5XX), (503, Reason.UPSTREAM_5XX),
])  # fmt: skip
def test_an_upstream_status_is_one_reason_for_a_judged_body_and_a_copied_one(status: int, reason: Reason) -> None:
    assert reason_for_status(status) is reason
    if status >= 400:  # (a judged error body keeps the reason of its status)
        judged = judge_body(DIALECTS["chat_completions"], RequestInfo(), status, "application/json", b"{}")
        assert judged.reason is reason
