"""Token latency (ITL, TPOT) and the abort phase: the sans-IO parts, fed by hand."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.core.dialects import for_request
from proxy.core.guard import StreamGuard
from proxy.core.latency import ITL_BUCKETS, TokenGaps
from proxy.core.lifecycle import Lifecycle, Phase
from proxy.core.record import ExchangeRecord
from proxy.observe.books import abort_phase
from proxy.observe.gaps import GapHistogram


def test_gaps_between_writes_and_zero_inside_one_write() -> None:
    gaps = TokenGaps()
    gaps.note(10.0, 1)  # the first content: no gap yet
    assert (gaps.events, gaps.gaps, gaps.time_per_output_token()) == (1, 0, None)
    gaps.note(10.02, 1)
    gaps.note(10.52, 3)  # three events in one write: one gap of 0.5 s, two of 0
    assert gaps.events == 5
    assert gaps.gaps == 4 == sum(gaps.counts)
    assert gaps.total == pytest.approx(0.52)
    assert gaps.counts[ITL_BUCKETS.index(0.5)] == 1  # le is inclusive
    assert gaps.counts[ITL_BUCKETS.index(0.02)] == 1
    assert gaps.counts[0] == 2
    assert gaps.time_per_output_token() == pytest.approx(0.52 / 4)


def test_no_events_and_a_clock_going_back() -> None:
    gaps = TokenGaps()
    gaps.note(5.0, 0)
    assert gaps.events == 0
    gaps.note(5.0, 1)
    gaps.note(4.0, 1)
    assert gaps.total == 0.0
    assert gaps.counts[0] == 1
    gaps.note(7.0, 1)  # beyond every bound: +Inf
    assert gaps.counts[-1] == 1


@given(st.lists(st.tuples(st.floats(0, 5, allow_nan=False), st.integers(1, 4)), min_size=1, max_size=30))
def test_sum_over_count_is_the_time_per_output_token(steps: list[tuple[float, int]]) -> None:
    gaps = TokenGaps()
    now = 0.0
    for delay, events in steps:
        now += delay
        gaps.note(now, events)
    assert sum(gaps.counts) == gaps.events - 1
    tpot = gaps.time_per_output_token()
    if gaps.events >= 2:
        assert tpot is not None
        assert gaps.total / (gaps.events - 1) == pytest.approx(tpot, abs=1e-9)
    else:
        assert tpot is None


def test_gap_histogram_exposes_cumulative_buckets_per_api() -> None:
    registry = CollectorRegistry()
    histogram = GapHistogram("test_itl_seconds", "gaps", ITL_BUCKETS)
    registry.register(histogram)
    assert b"test_itl_seconds_bucket" not in generate_latest(registry)  # no series before an ok stream
    gaps = TokenGaps()
    for t, n in ((0.0, 1), (0.004, 1), (0.124, 2), (3.124, 1)):
        gaps.note(t, n)
    histogram.merge("chat_completions", gaps)
    histogram.merge("chat_completions", gaps)
    [family] = [f for f in text_string_to_metric_families(generate_latest(registry).decode())
                if f.name == "test_itl_seconds"]
    assert family.type == "histogram"
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert samples[("test_itl_seconds_bucket", "0.005")] == 4  # 0.004 and the 0 of the pair, twice
    assert samples[("test_itl_seconds_bucket", "0.1")] == 4
    assert samples[("test_itl_seconds_bucket", "0.15")] == 6
    assert samples[("test_itl_seconds_bucket", "2.5")] == 6
    assert samples[("test_itl_seconds_bucket", "+Inf")] == 8
    assert samples[("test_itl_seconds_count", None)] == 8
    assert samples[("test_itl_seconds_sum", None)] == pytest.approx(2 * 3.124)


def _ex(phase: str, *, stream: bool = False, status: int | None = None, content: bool = False) -> ExchangeRecord:
    ex = ExchangeRecord("r", "POST", "/v1/chat/completions", "chat_completions", None)
    ex.phase, ex.stream, ex.upstream_status = phase, stream, status
    if content:
        ex.first_content_at = ex.started + 0.1
    return ex


@pytest.mark.parametrize(
    ("ex", "phase"),
    [
        (_ex(Phase.RECEIVED), "before_headers"),  # the client's body was still being read
        (_ex(Phase.RECEIVED, stream=True), "before_headers"),
        (_ex(Phase.AWAITING_HEADERS, stream=True), "before_headers"),
        (_ex(Phase.STREAMING, stream=True, status=200), "before_first_token"),  # held or committed
        (_ex(Phase.STREAMING, stream=True, status=200, content=True), "mid_stream"),
        (_ex(Phase.RESPONDING_WHOLE, status=200), "whole_body"),
        (_ex(Phase.RESPONDING_WHOLE, stream=True, status=429), "whole_body"),  # a stream request answered 429
        (_ex(Phase.RESPONDING_WHOLE, stream=True, status=200), "whole_body"),  # a JSON answer to a stream request
        (_ex(Phase.RESPONDING_WHOLE, status=500), "whole_body"),
    ],
)
def test_abort_phase_from_the_record(ex: ExchangeRecord, phase: str) -> None:
    assert abort_phase(ex) == phase


def test_the_verdict_time_is_the_abort_time() -> None:
    ex = _ex(Phase.RECEIVED)
    life = Lifecycle(ex)
    life.client_gone()
    first = ex.settled_at
    assert first is not None
    assert life.bug() is None  # a later cleanup moves neither the verdict nor its time
    assert (ex.outcome, ex.settled_at, ex.phase) == ("aborted", first, "received")


def _chunk(text: str) -> bytes:
    return b'data: {"choices":[{"index":0,"delta":{"content":"' + text.encode() + b'"}}]}\n\n'


@pytest.mark.parametrize("split", [1, 7, 40, 10_000])
def test_steps_count_the_content_events_they_carry(split: int) -> None:
    body = b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n' + b"".join(
        _chunk(t) for t in "abcdef"
    ) + b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
    guard = StreamGuard(for_request("POST", "/v1/chat/completions"), hold=True)
    carried = 0
    for i in range(0, len(body), split):
        step = guard.feed(body[i:i + split])
        carried += step.content_events
        assert step.content_events == 0 or step.data  # counted events are in this step's bytes
    assert carried == guard.content_events == 6


def test_the_bench_measures_the_cost_per_event() -> None:
    """The figure itself belongs to `streamwarden bench`; here only that it is measured and printed."""
    from proxy.tools.bench.latency import format_latency_cost, measure_latency_cost

    cost = measure_latency_cost(streams=20, tokens=10)
    assert cost.events == 200
    assert cost.per_event_ns >= cost.note_ns > 0
    assert all(len(line) <= 80 for line in format_latency_cost(cost).splitlines())
