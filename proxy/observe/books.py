"""One exchange's record and the single place where it is counted, logged and traced, exactly once.

The handler moves an `ExchangeRecord` through its phases and fills in what it learns; `Books.finish`
turns the final record into metrics, one log line and (with tracing on) one span. Nothing else writes
the request metrics. What the books derive from the record (where an abort happened, the token
latency of an ok stream, the level of its log line) is decided here, from the record alone.

The line's level follows the outcome, so that `--log-level warning`, what production runs, keeps every
failure and drops only the successes: `ok` and `aborted` (the client's choice) at info, `error` at
warning, `proxy_error` (a bug of ours) at error. A scrape of the backend's own `/metrics` through the
main port is forwarded like any path but is not model traffic: no metrics, its line at debug.
"""

from __future__ import annotations

from time import monotonic
from typing import TYPE_CHECKING, Any

from proxy.core.latency import TokenGaps
from proxy.core.lifecycle import Outcome, Phase, Reason
from proxy.core.record import ExchangeRecord
from proxy.core.resume.resumer import ResumeResult
from proxy.observe.logs import MAX_LOGGED_STRING, LineWriter, Logger
from proxy.observe.metrics import Metrics

if TYPE_CHECKING:
    from collections.abc import Mapping, MutableMapping

    from proxy.observe.tracing import Tracing

__all__ = ["Books", "ExchangeRecord", "abort_phase", "is_scrape", "log_level"]

_SCRAPE_PATHS = frozenset({"/metrics", "/metrics/"})
# The request line's fields that can carry a client's or the upstream's text (the rest are numbers, the
# peer's address and the proxy's own words): the only ones the line's cleaning must look at.
_EXTERNAL = ("request_id", "method", "path", "model", "client", "upstream_message", "cause")


def is_scrape(ex: ExchangeRecord) -> bool:
    """A Prometheus scrape of the backend's own metrics through the main port (not model traffic)."""
    return ex.api == "other" and ex.method in ("GET", "HEAD") and ex.path in _SCRAPE_PATHS


def log_level(outcome: str, reason: str) -> str:
    """The level of a request line: what a `--log-level warning` deployment must still see is a failure."""
    if outcome != Outcome.ERROR:
        return "info"
    return "error" if reason == Reason.PROXY_ERROR else "warning"


def abort_phase(ex: ExchangeRecord) -> str:
    """Where the client left, from the phase the lifecycle took its verdict in: before any upstream
    answer, before a stream's first content (held or committed), mid-stream, or during a whole body."""
    if ex.phase == Phase.STREAMING:
        return "before_first_token" if ex.first_content_at is None else "mid_stream"
    if ex.phase == Phase.RESPONDING_WHOLE:
        return "whole_body"
    return "before_headers"


class Books:
    """Writes an exchange's metrics and its log line when it finishes (and its span, with tracing on)."""

    def __init__(self, metrics: Metrics, logger: Any, tracing: Tracing | None = None) -> None:
        self.metrics = metrics
        self.logger = logger
        self.tracing = tracing
        # `proxy.observe.logs.Logger` renders the request line in one step (its `LineWriter`, called
        # directly) and says up front when its level drops it, so that nothing is built for a
        # dropped line; any other logger (structlog's own) gets the line through its level's method.
        self._writer: LineWriter | None = logger.writer if type(logger) is Logger else None

    def start(self, ex: ExchangeRecord, headers: Mapping[str, str] | None = None) -> None:
        """The exchange arrived; `headers` (the client's) may carry a trace context to continue."""
        if ex.api == "other" and is_scrape(ex):  # (`is_scrape`'s first test, without its call)
            return
        self.metrics.counts.started(ex.api)
        if self.tracing is not None:
            self.tracing.begin(ex, headers)

    def propagate(self, ex: ExchangeRecord, upstream_headers: MutableMapping[str, str]) -> None:
        """Send the proxy's span context upstream (`traceparent`/`tracestate`), replacing the client's."""
        if self.tracing is not None:
            self.tracing.inject(ex, upstream_headers)

    def finish(self, ex: ExchangeRecord) -> None:
        if ex.booked:
            return
        ex.booked = True
        api = ex.api
        if api == "other" and is_scrape(ex):
            self._log_scrape(ex)
            return
        m = self.metrics
        now = monotonic()
        model = m.models.label(ex.model)
        outcome, reason = ex.outcome or Outcome.ERROR, ex.reason or Reason.PROXY_ERROR  # nothing settled: our bug
        started, first = ex.started, ex.first_content_at
        ttft = None if first is None else first - started
        code = str(ex.upstream_status) if ex.upstream_status else "none"
        # The tokens: usage from the upstream where it gave it; else a stream's delivered content
        # events, estimated. A stream that ends early often has its prompt count (vLLM's first chunk,
        # Anthropic's `message_start`) but no completion count: the prompt is booked from usage, the
        # completion as estimated, and the log line says `estimated`. A resumed stream's usage is
        # estimated too when a continuation went out on the chunks' count of the answer so far.
        resumer = ex.resumer
        given = "estimated" if resumer is not None and resumer.estimated else "usage"
        prompt, completion, estimated = ex.prompt_tokens or 0, ex.completion_tokens, 0
        if completion is not None:
            usage_source: str | None = given
        elif ex.content_events:
            ex.completion_tokens = estimated = ex.content_events
            usage_source, completion = "estimated", 0
        else:
            usage_source, completion = given if prompt else None, 0
        m.counts.finished(api, model, outcome, reason, code, now - started, ttft, prompt, completion, given, estimated)
        if ex.upstream_cancelled:
            m.cancellations.labels(api=api, reason=ex.upstream_cancelled).inc()
        if ex.rewrites:
            for rewrite in ex.rewrites:
                m.rewrites.labels(api=api, reason=rewrite).inc()
        if resumer is not None:
            for broke, result in resumer.decisions:
                m.stream_resumes.labels(api=api, reason=broke, result=result).inc()
        phase = self._count_abort(ex, now) if outcome is Outcome.ABORTED else None
        if outcome is Outcome.OK and ex.gaps is not None:
            self.count_latency(api, ex.gaps)
        try:
            self._log(ex, outcome, reason, round((now - started) * 1000, 1), ttft, usage_source, phase)
        except Exception:  # the line must never fail the request; a bare one says what was lost
            self.logger.error("request_log_failed", request_id=ex.request_id, outcome=outcome, reason=reason)
        if ex.span is not None and self.tracing is not None:
            try:
                self.tracing.end(ex, outcome, reason, phase)
            except Exception:  # a tracing failure must never reach the client's response
                self.logger.exception("tracing_error", request_id=ex.request_id)

    def _log_scrape(self, ex: ExchangeRecord) -> None:
        self.logger.debug(
            "scrape", request_id=ex.request_id, path=ex.path, status=ex.status, upstream_status=ex.upstream_status,
            outcome=ex.outcome, reason=ex.reason, duration_ms=round((monotonic() - ex.started) * 1000, 1),
            client=ex.client,
        )

    def _log(
        self,
        ex: ExchangeRecord,
        outcome: str,
        reason: str,
        duration_ms: float,
        ttft: float | None,
        usage_source: str | None,
        phase: str | None,
    ) -> None:
        level = log_level(outcome, reason)
        writer = self._writer
        if writer is not None and writer.drops(level):
            return  # (the level drops the line: nothing to build)
        request_id, method, path, model, client = ex.request_id, ex.method, ex.path, ex.model, ex.client
        message, cause = ex.upstream_message, ex.cause
        fields = {
            "request_id": request_id,
            "method": method,
            "path": path,
            "api": ex.api,
            "model": model,
            "stream": ex.stream,
            "status": ex.status,
            "upstream_status": ex.upstream_status,
            "outcome": outcome,
            "reason": reason,
            "duration_ms": duration_ms,
            "ttft_ms": round(ttft * 1000, 1) if ttft is not None else None,
            "events": ex.events,
            "bytes_out": ex.bytes_out,
            "prompt_tokens": ex.prompt_tokens,
            "completion_tokens": ex.completion_tokens,
            "usage_source": usage_source,
            "upstream_cancelled": ex.upstream_cancelled is not None,
            "client": client,
            "abort_phase": phase,
        }
        external: tuple[str, ...] | None = _EXTERNAL
        extra = ex.client_request_id is not None or ex.resumer is not None
        if extra:
            if ex.client_request_id is not None:
                fields["client_request_id"] = ex.client_request_id
            if ex.resumer is not None:
                fields["resumes"] = ex.resumer.resumes
                if any(result is not ResumeResult.RESUMED for _, result in ex.resumer.decisions):
                    fields["resume_refusal"] = ex.resumer.refusal  # why the last break was not mended
            external = None  # (every string is cleaned)
        if message is not None:
            fields["upstream_message"] = message
        if cause is not None:
            fields["cause"] = cause
        if writer is None:
            getattr(self.logger, level)("request", **fields)
            return
        if not extra:
            # The texts that can come from outside tested at once, joined: when they are short printable
            # ASCII together (the usual request), none of them needs cleaning, one by one.
            texts = f"{request_id}{method}{path}{model or ''}{client or ''}{message or ''}{cause or ''}"
            if len(texts) <= MAX_LOGGED_STRING and texts.isascii() and texts.isprintable():
                external = ()
        writer.line(level, "request", fields, external=external)

    def _count_abort(self, ex: ExchangeRecord, now: float) -> str:
        """Where the client left; before any content, also how long it had waited (queueing pain)."""
        phase = abort_phase(ex)
        self.metrics.aborts.labels(api=ex.api, phase=phase).inc()
        if phase in ("before_headers", "before_first_token"):
            left = ex.settled_at if ex.settled_at is not None else now
            self.metrics.abort_wait.labels(api=ex.api).observe(left - ex.started)
        return phase

    def count_latency(self, api: str, gaps: TokenGaps) -> None:
        """An ok stream's gaps into the ITL histogram, and its time per output token."""
        if gaps.gaps:
            self.metrics.inter_token_latency.merge(api, gaps)
        tpot = gaps.time_per_output_token()
        if tpot is not None:
            self.metrics.time_per_output_token.labels(api=api).observe(tpot)
