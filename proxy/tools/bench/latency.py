"""`streamwarden bench`'s micro-benchmark of the token latency books (their budget: under 1 µs per event).

What a content event costs the proxy for the inter-token latency and time-per-output-token
histograms: the clock read and `ExchangeRecord.note_content` in the stream loop, plus, once per ok
stream, the books' merge into the ITL histogram and the TPOT observation, spread over the stream's
events. Measured in this process with `time.perf_counter_ns` over many streams; prometheus_client's own `observe()` per
event is measured beside it for scale. A figure, not a test: the suite only checks that it runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram

from proxy.core.latency import ITL_BUCKETS
from proxy.core.record import ExchangeRecord
from proxy.observe.books import Books
from proxy.observe.metrics import Metrics

__all__ = ["LatencyCost", "format_latency_cost", "measure_latency_cost"]


@dataclass(frozen=True)
class LatencyCost:
    per_event_ns: float  # note_content + the per-stream merge and TPOT, per content event
    note_ns: float  # note_content alone, per content event
    observe_ns: float  # prometheus_client Histogram.observe, per call (for scale)
    events: int


class _Quiet:
    def info(self, *args: object, **kwargs: object) -> None:
        pass


def measure_latency_cost(streams: int = 2_000, tokens: int = 200) -> LatencyCost:
    """Best of three rounds of `streams` ok streams of `tokens` content events each."""
    clock = time.monotonic
    metrics = Metrics(registry=CollectorRegistry())
    recorder = Books(metrics, _Quiet())
    per_event, note_only, observed = [], [], []
    histogram = Histogram("bench_itl_seconds", "", buckets=ITL_BUCKETS, registry=CollectorRegistry())
    for _ in range(3):
        total = notes = 0
        for _ in range(streams):
            ex = ExchangeRecord("bench", "POST", "/v1/chat/completions", "chat_completions", None)
            start = time.perf_counter_ns()
            for _ in range(tokens):
                ex.note_content(clock(), 1)  # the stream loop's line: read the clock, note the event
            noted = time.perf_counter_ns()
            gaps = ex.gaps
            assert gaps is not None
            recorder.count_latency(ex.api, gaps)  # what finish() does for an ok stream
            total += time.perf_counter_ns() - start
            notes += noted - start
        per_event.append(total / (streams * tokens))
        note_only.append(notes / (streams * tokens))
        calls = streams * tokens // 10
        start = time.perf_counter_ns()
        for i in range(calls):
            histogram.observe(0.02 + (i & 7) * 0.01)
        observed.append((time.perf_counter_ns() - start) / calls)
    return LatencyCost(min(per_event), min(note_only), min(observed), streams * tokens)


def format_latency_cost(cost: LatencyCost) -> str:
    """Three lines of at most 80 characters, like the rest of the bench's output."""
    return (
        f"token latency books (ITL + TPOT), {cost.events:,} content events\n"
        f"cost per content event      {cost.per_event_ns / 1000:.2f} us "
        f"({cost.note_ns / 1000:.2f} us in the stream loop)\n"
        f"prometheus_client observe() {cost.observe_ns / 1000:.2f} us per call, for scale"
    )
