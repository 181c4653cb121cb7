"""The metrics every exchange adds to, kept as plain numbers and rendered only when scraped.

`Books` adds to six families per exchange (requests, duration, upstream responses, TTFT, tokens,
in-flight). Through prometheus_client each addition is a child lookup, a lock and, with `--workers`,
an mmap write behind a `getpid()` system call; here one process adds to dicts keyed by label
tuples, and `collect` turns them into the same families (names, help, labels, types, buckets) at
scrape time. The proxy runs on one event loop, so adding and collecting never race.

With `--workers N` the supervisor reads the values from the workers' files, so a worker keeps
writing through prometheus_client (`SharedRequestCounts`): the contract is the same, the cost is
prometheus_client's.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

__all__ = ["DURATION_BUCKETS", "TTFT_BUCKETS", "PlainRequestCounts", "RequestCounts", "SharedRequestCounts"]

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# name, help, labels (the README's metrics table; the names without prometheus_client's `_total`)
REQUESTS = ("streamwarden_requests", "Exchanges by final outcome and reason.", ("api", "model", "outcome", "reason"))
DURATION = ("streamwarden_request_duration_seconds", "From request arrival to the end of the exchange.",
            ("api", "outcome"))  # fmt: skip
TTFT = ("streamwarden_time_to_first_token_seconds",
        "From request arrival to the first upstream event carrying generated content.", ("api", "model"))  # fmt: skip
INFLIGHT = ("streamwarden_inflight_requests", "Exchanges in progress.", ("api",))
UPSTREAM = ("streamwarden_upstream_responses", "Upstream response statuses (code=none: no response).", ("api", "code"))
TOKENS = ("streamwarden_tokens", "Tokens by kind, from the upstream's usage or estimated from delivered events.",
          ("api", "model", "kind", "source"))  # fmt: skip


class RequestCounts:
    """What `Books` adds to per exchange (the interface of both kinds)."""

    def started(self, api: str) -> None:
        raise NotImplementedError

    def finished(self, api: str, model: str, outcome: str, reason: str, code: str, seconds: float,
                 ttft: float | None, prompt: int = 0, completion: int = 0, given: str = "usage",
                 estimated: int = 0) -> None:  # fmt: skip
        """An exchange ended; with its tokens: `prompt` and `completion` from the upstream's usage
        (counted with `given` as their source), `estimated` completion tokens (from its events)."""
        raise NotImplementedError

    def tokens(self, api: str, model: str, kind: str, source: str, count: int) -> None:
        raise NotImplementedError


class _Buckets:
    """One histogram series: non-cumulative counts (the last is +Inf) and the sum."""

    __slots__ = ("counts", "total")

    def __init__(self, size: int) -> None:
        self.counts = [0] * size
        self.total = 0.0


class _Count:
    """One counter series' value."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0


class _Ending:
    """The series one kind of ending adds to (an api, model, outcome, reason and upstream code): found
    with one lookup per exchange instead of one per family. The TTFT and token series are found at
    their first value (the tokens of the usual sources: the upstream's usage, estimated completions)."""

    __slots__ = ("completion_estimated", "completion_usage", "duration", "prompt_usage", "requests", "ttft",
                 "upstream")  # fmt: skip

    def __init__(self, requests: _Count, upstream: _Count, duration: _Buckets, ttft: _Buckets | None) -> None:
        self.requests = requests
        self.upstream = upstream
        self.duration = duration
        self.ttft = ttft
        self.prompt_usage: _Count | None = None
        self.completion_usage: _Count | None = None
        self.completion_estimated: _Count | None = None


class PlainRequestCounts(RequestCounts, Collector):
    """One process: dicts on the hot path, prometheus families at scrape time."""

    def __init__(self, apis: Sequence[str]) -> None:
        self._requests: dict[tuple[str, ...], _Count] = {}
        self._upstream: dict[tuple[str, ...], _Count] = {}
        self._tokens: dict[tuple[str, ...], _Count] = {}
        self._inflight: dict[str, float] = dict.fromkeys(apis, 0.0)  # every api's series exists at 0
        self._duration: dict[tuple[str, ...], _Buckets] = {}
        self._ttft: dict[tuple[str, ...], _Buckets] = {}
        self._endings: dict[tuple[str, ...], _Ending] = {}

    def started(self, api: str) -> None:
        self._inflight[api] = self._inflight.get(api, 0.0) + 1

    def finished(self, api: str, model: str, outcome: str, reason: str, code: str, seconds: float,
                 ttft: float | None, prompt: int = 0, completion: int = 0, given: str = "usage",
                 estimated: int = 0) -> None:  # fmt: skip
        inflight = self._inflight
        inflight[api] = inflight.get(api, 0.0) - 1
        ending = self._endings.get((api, model, outcome, reason, code))
        if ending is None:
            ending = self._ending(api, model, outcome, reason, code)
        ending.requests.value += 1
        ending.upstream.value += 1
        duration = ending.duration
        duration.counts[bisect_left(DURATION_BUCKETS, seconds)] += 1  # (a value on a bound is in its bucket)
        duration.total += seconds
        if ttft is not None:
            series = ending.ttft
            if series is None:
                series = ending.ttft = _series(self._ttft, (api, model), len(TTFT_BUCKETS) + 1)
            series.counts[bisect_left(TTFT_BUCKETS, ttft)] += 1
            series.total += ttft
        if given != "usage":  # (a resumed stream's estimated usage: its series looked up)
            if prompt:
                self.tokens(api, model, "prompt", given, prompt)
            if completion:
                self.tokens(api, model, "completion", given, completion)
        else:
            if prompt:
                cell = ending.prompt_usage
                if cell is None:
                    cell = ending.prompt_usage = _counter(self._tokens, (api, model, "prompt", "usage"))
                cell.value += prompt
            if completion:
                cell = ending.completion_usage
                if cell is None:
                    cell = ending.completion_usage = _counter(self._tokens, (api, model, "completion", "usage"))
                cell.value += completion
        if estimated:
            cell = ending.completion_estimated
            if cell is None:
                cell = ending.completion_estimated = _counter(self._tokens, (api, model, "completion", "estimated"))
            cell.value += estimated

    def _ending(self, api: str, model: str, outcome: str, reason: str, code: str) -> _Ending:
        """The series of an ending not met before (theirs may exist: other endings share them)."""
        requests = _counter(self._requests, (api, model, outcome, reason))
        upstream = _counter(self._upstream, (api, code))
        duration = _series(self._duration, (api, outcome), len(DURATION_BUCKETS) + 1)
        ending = self._endings[(api, model, outcome, reason, code)] = _Ending(
            requests, upstream, duration, self._ttft.get((api, model))
        )
        return ending

    def tokens(self, api: str, model: str, kind: str, source: str, count: int) -> None:
        _counter(self._tokens, (api, model, kind, source)).value += count

    def describe(self) -> Iterator[Metric]:
        return self._families(empty=True)

    def collect(self) -> Iterator[Metric]:
        return self._families(empty=False)

    def _families(self, *, empty: bool) -> Iterator[Metric]:
        for (name, doc, labels), values in ((REQUESTS, _values(self._requests)), (UPSTREAM, _values(self._upstream)),
                                            (TOKENS, _values(self._tokens))):  # fmt: skip
            counter = CounterMetricFamily(name, doc, labels=labels)
            if not empty:
                for key, value in values.items():
                    counter.add_metric(key, value)
            yield counter
        for (name, doc, labels), series, bounds in ((DURATION, self._duration, DURATION_BUCKETS),
                                                    (TTFT, self._ttft, TTFT_BUCKETS)):  # fmt: skip
            histogram = HistogramMetricFamily(name, doc, labels=labels)
            if not empty:
                edges = [*(floatToGoString(b) for b in bounds), "+Inf"]  # type: ignore[no-untyped-call]
                for key, buckets in series.items():
                    cumulative, pairs = 0, []
                    for edge, n in zip(edges, buckets.counts, strict=True):
                        cumulative += n
                        pairs.append((edge, float(cumulative)))
                    histogram.add_metric(key, pairs, buckets.total)
            yield histogram
        gauge_name, gauge_doc, gauge_labels = INFLIGHT
        gauge = GaugeMetricFamily(gauge_name, gauge_doc, labels=gauge_labels)
        if not empty:
            for api, value in self._inflight.items():
                gauge.add_metric((api,), value)
        yield gauge


def _series(series: dict[tuple[str, ...], _Buckets], key: tuple[str, ...], size: int) -> _Buckets:
    buckets = series.get(key)
    if buckets is None:
        buckets = series[key] = _Buckets(size)
    return buckets


def _counter(series: dict[tuple[str, ...], _Count], key: tuple[str, ...]) -> _Count:
    count = series.get(key)
    if count is None:
        count = series[key] = _Count()
    return count


def _values(series: dict[tuple[str, ...], _Count]) -> dict[tuple[str, ...], float]:
    return {key: count.value for key, count in series.items()}


class SharedRequestCounts(RequestCounts):
    """`--workers N`: the same families through prometheus_client, in this worker's multiprocess files."""

    def __init__(self, registry: CollectorRegistry, apis: Sequence[str]) -> None:
        self.requests = Counter(*REQUESTS[:2], REQUESTS[2], registry=registry)
        self.duration = Histogram(*DURATION[:2], DURATION[2], buckets=DURATION_BUCKETS, registry=registry)
        self.ttft = Histogram(*TTFT[:2], TTFT[2], buckets=TTFT_BUCKETS, registry=registry)
        self.inflight = Gauge(*INFLIGHT[:2], INFLIGHT[2], registry=registry, multiprocess_mode="livesum")
        self.upstream = Counter(*UPSTREAM[:2], UPSTREAM[2], registry=registry)
        self.token_counts = Counter(*TOKENS[:2], TOKENS[2], registry=registry)
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}
        for api in apis:
            self.inflight.labels(api)

    def _child(self, metric: Any, *values: str) -> Any:
        """`metric.labels(*values)`, looked up once per label set (the label sets are bounded)."""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def started(self, api: str) -> None:
        self._child(self.inflight, api).inc()

    def finished(self, api: str, model: str, outcome: str, reason: str, code: str, seconds: float,
                 ttft: float | None, prompt: int = 0, completion: int = 0, given: str = "usage",
                 estimated: int = 0) -> None:  # fmt: skip
        child = self._child
        child(self.inflight, api).dec()
        child(self.requests, api, model, outcome, reason).inc()
        child(self.duration, api, outcome).observe(seconds)
        child(self.upstream, api, code).inc()
        if ttft is not None:
            child(self.ttft, api, model).observe(ttft)
        if prompt:
            self.tokens(api, model, "prompt", given, prompt)
        if completion:
            self.tokens(api, model, "completion", given, completion)
        if estimated:
            self.tokens(api, model, "completion", "estimated", estimated)

    def tokens(self, api: str, model: str, kind: str, source: str, count: int) -> None:
        self._child(self.token_counts, api, model, kind, source).inc(count)
