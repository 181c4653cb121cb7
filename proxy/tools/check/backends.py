"""What the check knows of each backend's own metrics: the prefix that names it, the counter of
generated tokens and the gauge of requests in progress, and a small Prometheus text reader.

Sources: llama.cpp `tools/server` (`--metrics`: `llamacpp:tokens_predicted_total`, booked when a
request ends, and `llamacpp:requests_processing`), vLLM's production metrics (`vllm:generation_tokens_total`,
per engine step, `vllm:num_requests_running`), SGLang's (`--enable-metrics`:
`sglang:generation_tokens_total`, `sglang:num_running_reqs`), and the fake upstream's own. Labelled
samples (vLLM and SGLang label by model and engine) are summed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["BACKENDS", "Backend", "backend_for", "metric_prefixes", "metric_sum"]


@dataclass(frozen=True, slots=True)
class Backend:
    name: str
    prefix: str
    generated: str  # counter of generated tokens
    running: str  # gauge of requests being generated
    abort_hook: str | None = None  # the `--cancel-hook` its abort API takes, when it has one
    version_path: str | None = None  # a GET that tells its version, and the JSON key holding it
    version_key: str = "version"


BACKENDS = (
    Backend(
        "llama.cpp llama-server",
        "llamacpp:",
        "llamacpp:tokens_predicted_total",
        "llamacpp:requests_processing",
        version_path="/props",
        version_key="build_info",
    ),
    Backend("vLLM", "vllm:", "vllm:generation_tokens_total", "vllm:num_requests_running", version_path="/version"),
    Backend(
        "SGLang",
        "sglang:",
        "sglang:generation_tokens_total",
        "sglang:num_running_reqs",
        abort_hook="'POST /abort_request {\"rid\": \"{request_id}\"}'",
    ),
    Backend(
        "streamwarden fake-upstream",
        "fake_upstream:",
        "fake_upstream:generation_tokens_total",
        "fake_upstream:requests_running",
    ),
)


def _samples(text: str) -> list[tuple[str, float]]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name_end = len(line)
        for stop in ("{", " "):
            at = line.find(stop)
            if 0 <= at < name_end:
                name_end = at
        rest = line[name_end:]
        if rest.startswith("{"):
            close = rest.find("}")
            if close < 0:
                continue
            rest = rest[close + 1 :]
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        out.append((line[:name_end], value))
    return out


def metric_prefixes(text: str) -> list[str]:
    """The prefixes (up to and including a colon or the first underscore) of the samples, most used first."""
    counts: dict[str, int] = {}
    for name, _ in _samples(text):
        cut = name.find(":")
        prefix = name[: cut + 1] if cut >= 0 else name.split("_", 1)[0] + "_"
        counts[prefix] = counts.get(prefix, 0) + 1
    return sorted(counts, key=lambda p: -counts[p])


def metric_sum(text: str, name: str) -> float | None:
    """The sum of every sample of ``name`` (any labels); ``None`` when the page has none."""
    values = [v for n, v in _samples(text) if n == name and math.isfinite(v)]
    return sum(values) if values else None


def backend_for(text: str) -> Backend | None:
    """The known backend whose generated-token counter this page carries."""
    for backend in BACKENDS:
        if metric_sum(text, backend.generated) is not None:
            return backend
    return None
