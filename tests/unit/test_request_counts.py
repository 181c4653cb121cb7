"""The plain per-exchange counts render exactly what prometheus_client renders for the same additions:
the same families, types, help, labels, bucket edges (a value on a bound included), values."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.observe.metrics import APIS
from proxy.observe.request_counts import DURATION_BUCKETS, PlainRequestCounts, RequestCounts, SharedRequestCounts

EXCHANGES = [
    ("chat_completions", "m", "ok", "complete", "200", 0.7, None),
    ("chat_completions", "m", "ok", "complete", "200", 0.05, 0.01),  # both on a bucket bound
    ("chat_completions", "m", "error", "upstream_aborted", "200", 0.2, 0.02),  # the same TTFT series
    ("chat_completions", "m", "ok", "complete", "200", 0.3, 0.5),
    ("responses", "other", "error", "upstream_5xx", "503", 700.0, None),  # past the last bound: +Inf only
    ("embeddings", "unknown", "aborted", "client_gone", "none", 0.0, 0.3),
]
# Tokens booked with the exchange's end: (prompt, completion, their source, estimated completion).
TOKENS = [(8, 100, "usage", 0), (0, 0, "usage", 0), (5, 0, "usage", 4), (2, 3, "estimated", 0), (0, 0, "usage", 0),
          (1, 0, "usage", 0)]  # fmt: skip


def _feed(counts: RequestCounts) -> None:
    for api, *_ in EXCHANGES:
        counts.started(api)
    counts.started("models")  # still in flight at the scrape
    for (api, model, outcome, reason, code, seconds, ttft), tokens in zip(EXCHANGES, TOKENS, strict=True):
        counts.finished(api, model, outcome, reason, code, seconds, ttft, *tokens)
        counts.tokens(api, model, "prompt", "usage", 3)
    counts.tokens("chat_completions", "m", "completion", "estimated", 7)


Samples = set[tuple[str, tuple[tuple[str, str], ...], float]]


def _families(registry: CollectorRegistry) -> dict[str, tuple[str, str, Samples]]:
    return {
        family.name: (family.type, family.documentation,
                      {(s.name, tuple(sorted(s.labels.items())), s.value) for s in family.samples})
        for family in text_string_to_metric_families(generate_latest(registry).decode())
    }  # fmt: skip


def test_plain_counts_render_what_prometheus_client_renders() -> None:
    disable_created_metrics()  # type: ignore[no-untyped-call]  # (as `Metrics` does: no `_created` series)
    plain_registry, shared_registry = CollectorRegistry(), CollectorRegistry()
    plain = PlainRequestCounts(APIS)
    plain_registry.register(plain)
    shared = SharedRequestCounts(shared_registry, APIS)
    _feed(plain)
    _feed(shared)
    got, want = _families(plain_registry), _families(shared_registry)
    assert got == want
    assert len(want) == 6
    duration = {s[1]: s[2] for s in want["streamwarden_request_duration_seconds"][2]
                if s[0].endswith("_bucket") and ("outcome", "ok") in s[1]}  # fmt: skip
    assert duration[(("api", "chat_completions"), ("le", str(DURATION_BUCKETS[0])), ("outcome", "ok"))] == 1


def test_an_unscraped_registry_still_names_every_family() -> None:
    registry = CollectorRegistry()
    registry.register(PlainRequestCounts(APIS))
    names = {family.name for family in registry.collect()}
    assert names == {"streamwarden_requests", "streamwarden_upstream_responses", "streamwarden_tokens",
                     "streamwarden_request_duration_seconds", "streamwarden_time_to_first_token_seconds",
                     "streamwarden_inflight_requests"}  # fmt: skip
