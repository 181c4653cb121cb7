"""The Prometheus contract (the README's metrics table), on a registry of its own (no process globals).

Label values come from fixed sets; the request's model name, the one free-form label, is bounded by
`ModelLabels` so that a client sending 10,000 model names cannot create 10,000 series.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    values,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

from proxy import __version__
from proxy.core.compile_attrs import mypyc_attr
from proxy.core.latency import ITL_BUCKETS
from proxy.core.lifecycle import Cancellation
from proxy.core.resume.resumer import ResumeResult
from proxy.core.resume.rules import RESUMABLE_REASONS
from proxy.core.verdicts import Rewrite
from proxy.observe.gaps import GapHistogram
from proxy.observe.request_counts import (
    TTFT_BUCKETS,
    PlainRequestCounts,
    RequestCounts,
    SharedRequestCounts,
)

__all__ = [
    "ABORT_PHASES", "APIS", "CANCELLATION_REASONS", "CANCEL_HOOK_FAILURE_REASONS", "CONTENT_TYPE_LATEST",
    "RESUME_APIS", "RESUME_REASONS", "RESUME_RESULTS", "REWRITE_REASONS", "Metrics", "ModelLabels",
    "keep_values_in_memory",
]

APIS = ("chat_completions", "completions", "responses", "messages", "embeddings", "models", "other")
CANCELLATION_REASONS = tuple(str(reason) for reason in Cancellation)
# Besides the call's own failures: `invalid_id` (an id too long, or not UTF-8 for a JSON body: not
# sent), `dropped` (past the hooks' in-flight bound), `cut` (in flight when shutdown's drain ended),
# `error` (a bug in a hook).
# `invalid_body` is not produced (a placeholder is always a JSON string); its series is kept for the
# dashboards and alerts that name it.
CANCEL_HOOK_FAILURE_REASONS = (
    "timeout", "connect_failed", "http_status", "invalid_body", "invalid_id", "dropped", "cut", "error",
)
REWRITE_REASONS = tuple(str(rewrite) for rewrite in Rewrite)

# --resume-on-cut: the streams it continues, the breaks it counts, what came of each.
RESUME_APIS = ("chat_completions", "completions")
RESUME_REASONS = tuple(sorted(str(reason) for reason in RESUMABLE_REASONS))
RESUME_RESULTS = tuple(str(result) for result in ResumeResult)

# Where the client left: the upstream had not answered yet; a stream with no content
# yet; a stream mid-way; a whole (non-stream) response being read or written.
ABORT_PHASES = ("before_headers", "before_first_token", "mid_stream", "whole_body")

# Time per output token of a whole stream: the ITL range, narrower at the top (an average smooths stalls).
TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
# How long a user waited before giving up with nothing received: the TTFT range.
ABORT_WAIT_BUCKETS = TTFT_BUCKETS
MODEL_NAME_MAX = 100


MAX_UPSTREAM_MODELS = 1000


@mypyc_attr(allow_interpreted_subclasses=True)  # (compiled: subclassed by the workers' labels)
class ModelLabels:
    """The models the upstream serves always keep their label; other names share `limit` slots.

    Without the upstream's list, the first `limit` names a client sends would own the labels for
    the life of the process, and junk sent early would turn every real model into `other`.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen: set[str] = set()
        self._served: frozenset[str] = frozenset()

    def set_served(self, names: list[str]) -> None:
        """The upstream's own model names (its `/v1/models`), refreshed with the readiness probe."""
        self._served = frozenset(name[:MODEL_NAME_MAX] for name in names[:MAX_UPSTREAM_MODELS])

    def label(self, model: str | None) -> str:
        """The label value of a model name: its own name (cut), `unknown`, or `other` once the slots are taken."""
        if not model:
            return "unknown"
        name = model[:MODEL_NAME_MAX]
        if name in self._served or name in self._seen:
            return name
        return self._admit(name)

    def _admit(self, name: str) -> str:
        """A name met for the first time: give it a slot while any is free (workers share theirs)."""
        if len(self._seen) >= self._limit:
            return "other"
        self._seen.add(name)
        return name


class Metrics:
    """Every streamwarden metric, registered on `registry`.

    With `--workers N` every process runs in prometheus_client's multiprocess mode (proxy/workers/supervisor.py
    switches itself and starts its workers with PROMETHEUS_MULTIPROC_DIR set): values live in per-process files under
    `multiprocess_dir` and `render` sums them, so the admin port shows one set of series, exactly as one
    process would. Gauges say how: in-flight exchanges are summed over live workers (`livesum`: a dead
    worker's exchanges are gone with it); `upstream_up` is the supervisor's probe (`livemax`: the
    workers never probe and hold 0, so the maximum is the probe's answer; `all` would add a `pid` label);
    `build_info` is 1 everywhere (`livemax`). Live modes, because a dead worker's gauge files are then
    removed with it (`mark_process_dead`). Counters and histograms are summed
    over every file, a dead worker's included, so that no counter ever goes backwards.
    """

    def __init__(
        self, model_label_limit: int = 50, registry: CollectorRegistry | None = None,
        multiprocess_dir: str | None = None,
    ) -> None:
        # The contract is the README's metric families (hook failures included); prometheus_client
        # would add a `*_created` gauge per counter and histogram series. (A library-wide switch, set once.)
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = registry if registry is not None else CollectorRegistry()
        self.multiprocess_dir = multiprocess_dir
        self.models = ModelLabels(model_label_limit)
        r = self.registry
        # The six families every exchange adds to (requests, duration, TTFT, in-flight, upstream
        # responses, tokens): plain numbers rendered at scrape time in one process; through
        # prometheus_client's multiprocess files in a worker (proxy/observe/request_counts.py).
        self.counts: RequestCounts
        if multiprocess_dir is None:
            plain = PlainRequestCounts(APIS)
            r.register(plain)
            self.counts = plain
        else:
            self.counts = SharedRequestCounts(r, APIS)
        self.cancellations = Counter(
            "streamwarden_upstream_cancellations", "Upstream requests the proxy cancelled, by why.",
            ["api", "reason"], registry=r,
        )
        self.cancel_hook_failures = Counter(
            "streamwarden_cancel_hook_failures", "--cancel-hook calls that failed, by how.",
            ["api", "reason"], registry=r,
        )
        self.rewrites = Counter(
            "streamwarden_stream_rewrites", "Changes the proxy made to what the upstream sent, by why.",
            ["api", "reason"], registry=r,
        )
        self.inter_token_latency = GapHistogram(
            "streamwarden_inter_token_latency_seconds",
            "Gaps between consecutive content-bearing events of ok streams, as the proxy forwarded them.",
            ITL_BUCKETS, multiprocess=multiprocess_dir is not None,
        )
        r.register(self.inter_token_latency)
        self.time_per_output_token = Histogram(
            "streamwarden_time_per_output_token_seconds",
            "Per ok stream: (last content - first content) / (content events - 1).",
            ["api"], buckets=TPOT_BUCKETS, registry=r,
        )
        self.aborts = Counter(
            "streamwarden_aborts", "Exchanges the client abandoned, by where it left.", ["api", "phase"], registry=r,
        )
        self.abort_wait = Histogram(
            "streamwarden_abort_wait_seconds",
            "From arrival to the abort, for aborts before the first token (before_headers, before_first_token).",
            ["api"], buckets=ABORT_WAIT_BUCKETS, registry=r,
        )
        self.stream_resumes = Counter(
            "streamwarden_stream_resumes",
            "--resume-on-cut: breaks of a committed stream, by why it broke and what came of it "
            "(resumed: a continuation answered; refused: none was tried; failed: the continuation was not answered "
            "with a stream).",
            ["api", "reason", "result"], registry=r,
        )
        self.upstream_up = Gauge(
            "streamwarden_upstream_up", "1 when the last upstream probe answered.", registry=r,
            multiprocess_mode="livemax",
        )
        self.build_info = Gauge(
            "streamwarden_build_info", "Always 1; carries the version.", ["version"], registry=r,
            multiprocess_mode="livemax",
        )
        self.build_info.labels(version=__version__).set(1)
        self.upstream_up.set(0)
        # Series that alerts take `increase()` of must exist at 0 before their first event, or the
        # first stall or stray block of a pod would never be seen. These label sets are fixed.
        for api in APIS:
            for reason in REWRITE_REASONS:
                self.rewrites.labels(api=api, reason=reason)
            for reason in CANCELLATION_REASONS:
                self.cancellations.labels(api=api, reason=reason)
            for phase in ABORT_PHASES:
                self.aborts.labels(api=api, phase=phase)
            for reason in CANCEL_HOOK_FAILURE_REASONS:
                self.cancel_hook_failures.labels(api=api, reason=reason)
        for api in RESUME_APIS:
            for reason in RESUME_REASONS:
                for result in RESUME_RESULTS:
                    self.stream_resumes.labels(api=api, reason=reason, result=result)

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=self.multiprocess_dir)  # type: ignore[no-untyped-call]
        return generate_latest(merged)


# prometheus_client's switch to multiprocess mode (the lower-case name is its deprecated spelling).
_MULTIPROC_VARIABLES = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")


def keep_values_in_memory() -> str | None:
    """One `serve` process: its values in its own memory, whatever directory it inherited.

    prometheus_client switches to multiprocess mode at import when PROMETHEUS_MULTIPROC_DIR is set; a
    single process that inherited it (a shell, a base image) would write into a directory it did not
    create, and two such instances would overwrite each other's counters. Called before any metric
    exists; the variable is also dropped from this process's environment. Returns the ignored value.
    """
    inherited = None
    for name in _MULTIPROC_VARIABLES:
        inherited = os.environ.pop(name, None) or inherited
    values.ValueClass = values.MutexValue
    return inherited
