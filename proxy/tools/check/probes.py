"""The probes that ask one question each with one or a few small requests: which dialects are served,
how a normal stream ends, whether usage is streamed, how bad requests are answered, what health and
metrics endpoints say. Each returns a ``Finding``; the rules live in ``verdicts``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proxy.tools.check.backends import Backend, backend_for, metric_prefixes
from proxy.tools.check.client import Unreachable, Upstream
from proxy.tools.check.report import FAIL, OK, QUIRK, UNKNOWN, UNSUPPORTED, Finding
from proxy.tools.check.requests import DIALECTS, body_for, chat_body
from proxy.tools.check.verdicts import (
    judge_context_overflow,
    judge_dialect,
    judge_malformed_json,
    judge_stream,
    judge_usage,
)

__all__ = [
    "Context",
    "context_length",
    "probe_context_overflow",
    "probe_dialect",
    "probe_health",
    "probe_malformed_json",
    "probe_metrics",
    "probe_stream_terminal",
    "probe_stream_usage",
]

SMALL = 8  # tokens per probe answer
MAX_OVERFLOW_WORDS = 600_000  # about 1.2 MB of prompt: enough for any context the backend announces


@dataclass
class Context:
    """What the probes share: the backend, the model, and what earlier probes learned."""

    upstream: Upstream
    model: str
    models_body: Any = None
    served: dict[str, bool] = field(default_factory=dict)  # dialect -> answered 2xx
    metrics_text: str | None = None
    backend: Backend | None = None
    context_length: int | None = None  # what the backend announces (set by the context overflow probe)


async def probe_dialect(ctx: Context, dialect: str) -> Finding:
    try:
        reply = await ctx.upstream.post(DIALECTS[dialect], body_for(dialect, ctx.model, SMALL, stream=False))
    except Unreachable as exc:
        return Finding(f"dialect.{dialect}", FAIL, f"no answer: {exc}")
    result, detail = judge_dialect(reply.status, reply.body)
    ctx.served[dialect] = result == OK
    return Finding(f"dialect.{dialect}", result, f"POST {DIALECTS[dialect]}: {detail}")


async def probe_stream_terminal(ctx: Context) -> Finding:
    """A normal stream in every served dialect; the worst verdict wins, each dialect is named."""
    served = [d for d in DIALECTS if ctx.served.get(d)]
    if not served:
        return Finding("stream.terminal", UNKNOWN, "no dialect answered a plain request")
    parts, verdicts = [], []
    for dialect in served:
        try:
            async with ctx.upstream.stream(DIALECTS[dialect], body_for(dialect, ctx.model, SMALL, stream=True)) as (
                stream,
                items,
            ):
                async for _ in items:
                    pass
        except Unreachable as exc:
            verdicts.append(FAIL)
            parts.append(f"{dialect}: no answer: {exc}")
            continue
        if not 200 <= stream.status < 300:
            verdicts.append(FAIL)
            parts.append(f"{dialect}: {stream.status}")
            continue
        result, detail = judge_stream(dialect, stream.items, stream.cut)
        verdicts.append(result)
        parts.append(f"{dialect}: {detail}")
    worst = next((r for r in (FAIL, QUIRK) if r in verdicts), OK)
    return Finding("stream.terminal", worst, "; ".join(parts))


async def probe_stream_usage(ctx: Context) -> Finding:
    if not ctx.served.get("chat_completions"):
        return Finding("stream.usage", UNKNOWN, "chat completions are not served")
    body = chat_body(ctx.model, SMALL, stream=True, stream_options={"include_usage": True})
    try:
        async with ctx.upstream.stream(DIALECTS["chat_completions"], body) as (stream, items):
            async for _ in items:
                pass
    except Unreachable as exc:
        return Finding("stream.usage", FAIL, f"no answer: {exc}")
    if not 200 <= stream.status < 300:
        return Finding("stream.usage", FAIL, f"{stream.status} for a stream with stream_options.include_usage")
    result, detail = judge_usage(stream.items, stream.cut)
    return Finding("stream.usage", result, detail)


async def probe_malformed_json(ctx: Context) -> Finding:
    try:
        reply = await ctx.upstream.post(DIALECTS["chat_completions"], b'{"messages": [')
    except Unreachable as exc:
        return Finding("errors.malformed_json", FAIL, f"no answer: {exc}")
    result, detail = judge_malformed_json(reply.status, reply.body)
    return Finding("errors.malformed_json", result, detail)


def context_length(models_body: Any, props_body: Any) -> int | None:
    """The context the backend announces: vLLM/SGLang `max_model_len` in /v1/models, llama-server's
    `n_ctx` in /props (the per-slot context) or its model's `meta.n_ctx_train`."""
    if isinstance(props_body, dict):
        settings = props_body.get("default_generation_settings")
        n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
        if isinstance(n_ctx, int) and n_ctx > 0:
            return n_ctx
    data = models_body.get("data") if isinstance(models_body, dict) else None
    for entry in data if isinstance(data, list) else ():
        if not isinstance(entry, dict):
            continue
        for value in (entry.get("max_model_len"), (entry.get("meta") or {}).get("n_ctx_train")):
            if isinstance(value, int) and value > 0:
                return value
    return None


async def probe_context_overflow(ctx: Context) -> Finding:
    dialect = "chat_completions" if ctx.served.get("chat_completions") else None
    if dialect is None:
        return Finding("errors.context_overflow", UNKNOWN, "chat completions are not served")
    props: Any = None
    try:
        reply = await ctx.upstream.get("/props")
        props = reply.json() if reply.status == 200 else None
    except Unreachable:
        props = None
    length = context_length(ctx.models_body, props)
    ctx.context_length = length
    if length is None:
        return Finding(
            "errors.context_overflow", UNKNOWN,
            "the backend announces no context length (/v1/models max_model_len, /props n_ctx): not probed",
        )  # fmt: skip
    words = length * 5 // 4 + 64  # a word of "x " is about one token
    if words > MAX_OVERFLOW_WORDS:
        return Finding(
            "errors.context_overflow", UNKNOWN, f"context {length}: a prompt beyond it is too large to send as a probe"
        )
    body = chat_body(ctx.model, SMALL, stream=False)
    body["messages"] = [{"role": "user", "content": "x " * words}]
    try:
        reply = await ctx.upstream.post(DIALECTS[dialect], body)
    except Unreachable as exc:
        return Finding("errors.context_overflow", FAIL, f"no answer to a prompt of {words} words: {exc}")
    result, detail = judge_context_overflow(dialect, reply.status, reply.body, words)
    return Finding("errors.context_overflow", result, f"context {length}; {detail}")


async def probe_health(ctx: Context) -> Finding:
    """Which health endpoints answer, and whether they agree with serving (a plain request succeeded).

    SGLang's `/health_generate` runs a one-token generation, so it also sees a hung engine; `/health`
    is the backend's own liveness (vLLM's turns 503 on a dead engine, llama-server's while it loads);
    `/v1/models` (the proxy's default `--health-path`) may be answered from configuration alone.
    """
    statuses: dict[str, int | None] = {}
    for path in ("/health", "/health_generate", "/v1/models"):
        try:
            statuses[path] = (await ctx.upstream.get(path)).status
        except Unreachable:
            statuses[path] = None
    seen = ", ".join(f"{p} {s if s is not None else 'no answer'}" for p, s in statuses.items())
    answering = [p for p, s in statuses.items() if s is not None and 200 <= s < 300]
    if not any(ctx.served.values()):
        if "/health" in answering or "/health_generate" in answering:
            return Finding("health", QUIRK, f"{seen}, yet no request succeeds: health does not reflect serving")
        return Finding("health", UNKNOWN, f"{seen}; no request succeeds")
    for path, why in (
        ("/health_generate", "it runs a generation, so a hung engine fails it too"),
        ("/health", "the backend's own check, where /v1/models may be answered from configuration"),
    ):
        if path in answering:
            return Finding("health", OK, f"{seen}; a request succeeds. {path}: {why}", (f"--health-path {path}",))
    if "/v1/models" in answering:
        return Finding("health", OK, f"{seen}; a request succeeds; the default --health-path /v1/models answers")
    return Finding("health", UNSUPPORTED, f"{seen}; a request succeeds but no health endpoint answers")


async def probe_metrics(ctx: Context) -> Finding:
    try:
        reply = await ctx.upstream.get("/metrics")
    except Unreachable as exc:
        return Finding("metrics", FAIL, f"no answer: {exc}")
    if reply.status in (404, 405, 501):
        return Finding(
            "metrics", UNSUPPORTED,
            f"GET /metrics: {reply.status} (llama-server needs --metrics, SGLang --enable-metrics)",
        )  # fmt: skip
    if reply.status != 200:
        return Finding("metrics", FAIL, f"GET /metrics: {reply.status}")
    text = reply.body.decode("utf-8", "replace")
    ctx.metrics_text = text
    ctx.backend = backend_for(text)
    prefixes = metric_prefixes(text)
    if not prefixes:
        return Finding("metrics", UNKNOWN, "GET /metrics: 200 without Prometheus samples")
    known = f" ({ctx.backend.name}: {ctx.backend.generated}, {ctx.backend.running})" if ctx.backend else ""
    return Finding(
        "metrics", OK,
        f"own /metrics, prefix {prefixes[0]}{known}; scrape the backend's port too, the proxy's metrics "
        "do not include them",
    )  # fmt: skip
