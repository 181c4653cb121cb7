"""One exchange's record and the single place where it is counted and logged, exactly once.

The handler moves an `Exchange` through its phases and fills in what it learns; `Recorder.finish`
turns the final record into metrics and one log line. Nothing else writes the request metrics.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .dialects import Usage
from .metrics import Metrics

__all__ = ["Exchange", "Phase", "Recorder"]


class Phase:
    RECEIVED = "received"
    AWAITING_HEADERS = "awaiting_headers"
    RESPONDING = "responding"
    FINISHED = "finished"


@dataclass(slots=True)
class Exchange:
    """What one request did; the fields of the `request` log line (design section 7)."""

    request_id: str
    method: str
    path: str
    api: str
    client: str | None
    started: float = field(default_factory=time.monotonic)
    phase: str = Phase.RECEIVED
    model: str | None = None
    stream: bool = False
    status: int | None = None
    upstream_status: int | None = None
    outcome: str | None = None
    reason: str | None = None
    first_content_at: float | None = None
    events: int = 0
    content_events: int = 0
    bytes_out: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    upstream_cancelled: str | None = None  # cancellation reason, when the proxy cancelled the upstream
    rewrites: list[str] = field(default_factory=list)
    committed: bool = False  # the client has received the status line
    drained: bool = False  # --on-abandon drain read the upstream to its end after the client left
    client_request_id: str | None = None  # a client's X-Request-Id that was not usable as given
    body_reserved: int = 0  # request-body bytes this exchange holds against --max-buffered-body-bytes
    interrupt: str | None = None  # set by the server (e.g. "shutdown") just before it cancels the handler

    def settle(self, outcome: str, reason: str) -> None:
        """Fix the verdict; the first one stands (a later cleanup cannot overwrite it)."""
        if self.outcome is None:
            self.outcome, self.reason = outcome, reason

    def record_usage(self, usage: Usage | None) -> None:
        """The upstream's own token counts, when it gave them."""
        if usage is not None:
            self.prompt_tokens, self.completion_tokens = usage.prompt_tokens, usage.completion_tokens

    def cancelled(self, reason: str) -> None:
        if self.upstream_cancelled is None:
            self.upstream_cancelled = reason


class Recorder:
    """Writes an exchange's metrics and its log line when it finishes."""

    def __init__(self, metrics: Metrics, logger: Any) -> None:
        self.metrics = metrics
        self.logger = logger

    def start(self, ex: Exchange) -> None:
        self.metrics.inflight.labels(api=ex.api).inc()

    def record_refusal(self, status: int, reason: str, bytes_out: int, *, client: str | None) -> None:
        """A connection-level refusal (bad HTTP, a header timeout, too many connections): one exchange."""
        ex = Exchange(uuid.uuid4().hex, "-", "-", "other", client)
        ex.status, ex.bytes_out = status, bytes_out
        ex.settle("error", reason)
        self.start(ex)
        self.finish(ex)

    def finish(self, ex: Exchange) -> None:
        if ex.phase == Phase.FINISHED:
            return
        ex.phase = Phase.FINISHED
        m = self.metrics
        now = time.monotonic()
        model = m.models.label(ex.model)
        outcome, reason = ex.outcome or "error", ex.reason or "proxy_error"  # nothing settled: our bug
        m.inflight.labels(api=ex.api).dec()
        m.requests.labels(api=ex.api, model=model, outcome=outcome, reason=reason).inc()
        m.duration.labels(api=ex.api, outcome=outcome).observe(now - ex.started)
        m.upstream_responses.labels(
            api=ex.api, code=str(ex.upstream_status) if ex.upstream_status else "none"
        ).inc()
        ttft = None
        if ex.first_content_at is not None:
            ttft = ex.first_content_at - ex.started
            m.ttft.labels(api=ex.api, model=model).observe(ttft)
        if ex.upstream_cancelled:
            m.cancellations.labels(api=ex.api, reason=ex.upstream_cancelled).inc()
        for rewrite in ex.rewrites:
            m.rewrites.labels(api=ex.api, reason=rewrite).inc()
        usage_source = self._count_tokens(ex, model)
        extra = {"client_request_id": ex.client_request_id} if ex.client_request_id is not None else {}
        try:
            self._log(ex, outcome, reason, now, ttft, usage_source, extra)
        except Exception:  # the line must never fail the request; a bare one says what was lost
            self.logger.error("request_log_failed", request_id=ex.request_id, outcome=outcome, reason=reason)

    def _log(
        self,
        ex: Exchange,
        outcome: str,
        reason: str,
        now: float,
        ttft: float | None,
        usage_source: str | None,
        extra: dict[str, str],
    ) -> None:
        self.logger.info(
            "request",
            request_id=ex.request_id,
            method=ex.method,
            path=ex.path,
            api=ex.api,
            model=ex.model,
            stream=ex.stream,
            status=ex.status,
            upstream_status=ex.upstream_status,
            outcome=outcome,
            reason=reason,
            duration_ms=round((now - ex.started) * 1000, 1),
            ttft_ms=round(ttft * 1000, 1) if ttft is not None else None,
            events=ex.events,
            bytes_out=ex.bytes_out,
            prompt_tokens=ex.prompt_tokens,
            completion_tokens=ex.completion_tokens,
            usage_source=usage_source,
            upstream_cancelled=ex.upstream_cancelled is not None,
            client=ex.client,
            **extra,
        )

    def _count_tokens(self, ex: Exchange, model: str) -> str | None:
        """Usage from the upstream where it gave it; else a stream's delivered content events, estimated.

        A stream that ends early often has its prompt count (vLLM's first chunk, Anthropic's
        `message_start`) but no completion count: the prompt is booked from usage, the completion
        as estimated, and the log line says `estimated`.
        """
        tokens = self.metrics.tokens
        source: str | None = None
        if ex.prompt_tokens:
            tokens.labels(api=ex.api, model=model, kind="prompt", source="usage").inc(ex.prompt_tokens)
            source = "usage"
        if ex.completion_tokens is not None:
            if ex.completion_tokens:
                tokens.labels(api=ex.api, model=model, kind="completion", source="usage").inc(ex.completion_tokens)
            return "usage"
        if ex.content_events:
            ex.completion_tokens = ex.content_events
            tokens.labels(api=ex.api, model=model, kind="completion", source="estimated").inc(ex.content_events)
            return "estimated"
        return source
