"""Token latency of a stream as the proxy forwarded it: inter-token gaps and time per output token.

Sans-IO. The stream loop tells a `TokenGaps` when it forwards content-bearing events (the monotonic
time and how many events went out in that write); the gaps land in a small per-exchange bucket array,
never in a Prometheus histogram directly, because only `ok` streams may feed the latency histograms
(OpenTelemetry defines them for successful responses) and the outcome is known only at the end. The
books then merge the array of an `ok` stream into `GapHistogram` in one step: per event, the cost
is one subtraction, one bisect and two additions.

Events forwarded in the same write have a gap of 0 (they reached the client together). So the
histogram's count is `content events - 1` per stream and its sum is `last - first`: `sum / count` over
a window is the mean time per output token, the same quantity as `streamwarden_time_per_output_token`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import values
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = ["ITL_BUCKETS", "GapHistogram", "TokenGaps"]

# Fit for 5 ms (a fast small model) to 2.5 s (a long prefill between chunks, a stalling backend).
ITL_BUCKETS = (
    0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip


class TokenGaps:
    """One stream's content-event times: first, last, how many, and its gaps bucketed by `bounds`."""

    __slots__ = ("_bounds", "counts", "events", "first", "last", "total")

    def __init__(self, bounds: Sequence[float] = ITL_BUCKETS) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # non-cumulative; the last slot is +Inf
        self.total = 0.0  # sum of the gaps
        self.events = 0
        self.first = 0.0
        self.last = 0.0

    def note(self, now: float, events: int) -> None:
        """`events` content-bearing events were forwarded at monotonic time `now`."""
        if events <= 0:
            return
        if self.events:
            gap = now - self.last
            if gap < 0.0:  # a clock that went back cannot make a negative latency
                gap = 0.0
            self.counts[bisect_left(self._bounds, gap)] += 1
            self.total += gap
        else:
            self.first = now
        if events > 1:
            self.counts[0] += events - 1  # forwarded together: gap 0, which every bucket holds
        self.events += events
        self.last = now

    @property
    def gaps(self) -> int:
        return self.events - 1 if self.events else 0

    def time_per_output_token(self) -> float | None:
        """(last content - first content) / (content events - 1); None below two events."""
        if self.events < 2:
            return None
        return (self.last - self.first) / (self.events - 1)


class GapHistogram(Collector):
    """A Prometheus histogram `{name}{api}` fed whole `TokenGaps` arrays rather than one value at a time.

    prometheus_client's `Histogram.observe` takes a lock and walks the buckets per call; merging an
    already bucketed array costs that once per stream. The proxy runs on one event loop, so merging
    and collecting never race.

    With `multiprocess` (`--workers N`) the counts are also written where prometheus_client's
    multiprocess mode keeps a `Histogram`'s (one value per bucket and a `_sum`, in this process's
    file), so the supervisor's merge sums them over the workers like any other histogram.
    """

    def __init__(
        self, name: str, documentation: str, bounds: Sequence[float] = ITL_BUCKETS, *, multiprocess: bool = False,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = tuple(bounds)
        self._edges = [*(floatToGoString(b) for b in self.bounds), "+Inf"]  # type: ignore[no-untyped-call]
        self._counts: dict[str, list[int]] = {}  # a series appears with its api's first ok stream
        self._sums: dict[str, float] = {}
        self._multiprocess = multiprocess
        self._shared: dict[str, tuple[list[Any], Any]] = {}  # api -> (bucket values, sum value) in the file

    def _shared_values(self, api: str) -> tuple[list[Any], Any]:
        found = self._shared.get(api)
        if found is None:
            make, doc = values.ValueClass, self.documentation
            buckets = [make("histogram", self.name, self.name + "_bucket", ("api", "le"), (api, edge), doc)
                       for edge in self._edges]  # fmt: skip
            total = make("histogram", self.name, self.name + "_sum", ("api",), (api,), doc)
            found = self._shared[api] = (buckets, total)
        return found

    def merge(self, api: str, gaps: TokenGaps) -> None:
        counts = self._counts.get(api)
        if counts is None:
            counts = self._counts[api] = [0] * (len(self.bounds) + 1)
            self._sums[api] = 0.0
        for i, n in enumerate(gaps.counts):
            if n:
                counts[i] += n
        self._sums[api] += gaps.total
        if self._multiprocess:
            buckets, total = self._shared_values(api)
            for i, n in enumerate(gaps.counts):
                if n:
                    buckets[i].inc(n)
            total.inc(gaps.total)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["api"])
        for api, counts in self._counts.items():
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for edge, n in zip(self._edges, counts, strict=True):
                cumulative += n
                buckets.append((edge, cumulative))
            family.add_metric([api], buckets, self._sums[api])
        yield family

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=["api"])

    def snapshot(self, api: str) -> tuple[list[int], float]:
        """(non-cumulative bucket counts, sum) of one api, for tests and the bench."""
        return list(self._counts.get(api, [])), self._sums.get(api, 0.0)
