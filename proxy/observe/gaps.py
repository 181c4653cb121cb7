"""The inter-token latency histogram, fed whole `TokenGaps` arrays (proxy/core/latency.py).

Here, not in the core: it is a Prometheus collector, and with --workers N it writes the multiprocess
files; the core only buckets the gaps of one stream.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import values
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from proxy.core.latency import ITL_BUCKETS, TokenGaps

__all__ = ["GapHistogram"]


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
