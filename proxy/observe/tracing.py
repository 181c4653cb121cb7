"""OpenTelemetry traces (the optional extra `streamwarden[otel]`): one server span per exchange.

The SDK is imported only when an OTLP endpoint is configured (`Tracing()`), so a proxy without the
extra or the endpoint pays nothing but one `is None` check per exchange. The span follows the GenAI
semantic conventions (named `{gen_ai.operation.name} {gen_ai.request.model}`), continues the client's
W3C `traceparent` / `tracestate`, and its own context is what goes upstream, so a vLLM started with
`--otlp-traces-endpoint` hangs its spans under the proxy's. Spans leave through the SDK's batch
processor (a thread of its own) and its standard OTLP/HTTP protobuf exporter; the event loop never
waits for a collector.

What a client sends (the model, the path) and what the upstream answers (its model, finish reasons)
is bounded and escaped exactly as in the log line: the batch processor holds up to 2,048 spans, and
one 30 MB model name per span would take the sidecar's memory. The SDK's own attribute limit is set
to the same cut when the operator set none (`OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT`). Shutdown flushes
and stops the SDK within the bound it is given whatever the collector does (`close`; `serve` gives
it at most 1 s, within the drain's bound), never at interpreter
exit on the SDK's own timeouts, and the SDK's log records go through the proxy's structured logger.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, MutableMapping
from typing import Any

from proxy import __version__
from proxy.config import otel_installed
from proxy.core.compile_attrs import mypyc_attr
from proxy.core.record import ExchangeRecord
from proxy.observe.logs import MAX_LOGGED_STRING, clean_text

__all__ = [
    "MAX_ATTRIBUTE_LENGTH", "MAX_FINISH_REASONS", "OPERATIONS", "SdkLogBridge", "Tracing", "otel_installed",
    "traces_url",
]

# gen_ai.operation.name by dialect; the rest (models, other) are plain HTTP spans.
OPERATIONS = {
    "chat_completions": "chat",
    "responses": "chat",
    "messages": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
}
_TRACE_HEADERS = ("traceparent", "tracestate")
# The SDK's backstop: the longest a logged string can be (256 characters, each escaped as at most `\uXXXX`).
MAX_ATTRIBUTE_LENGTH = MAX_LOGGED_STRING * 6
MAX_FINISH_REASONS = 16  # one per choice: `n` is the client's to choose
# The operator's own limit wins; SpanLimits reads these itself when given None.
_LIMIT_VARIABLES = ("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT")
_LEVELS = ((logging.ERROR, "error"), (logging.WARNING, "warning"), (logging.INFO, "info"))


def traces_url(endpoint: str) -> str:
    """OTEL_EXPORTER_OTLP_ENDPOINT is a base URL: OTLP/HTTP traces go to its `/v1/traces`."""
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


def _wall_ns(monotonic: float) -> int:
    """A `time.monotonic()` instant as the wall-clock nanoseconds spans are stamped with."""
    return time.time_ns() - int((time.monotonic() - monotonic) * 1e9)


@mypyc_attr(native_class=False)
class SdkLogBridge(logging.Handler):
    """The SDK's `logging` records ("Queue full, dropping Span.", a failed export) as structured lines.

    Without it they reach stderr through logging's last-resort handler, as raw text in a JSON log.
    A plain Python class in the compiled build too: logging keeps weak references to its handlers, and a
    native (compiled) subclass of the interpreted `logging.Handler` did not clear them when freed, so the
    next look at one crashed the process (the GC, or logging's shutdown at exit).
    """

    def __init__(self, logger: Any) -> None:
        super().__init__(logging.DEBUG)
        self._logger = logger

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level = next((name for number, name in _LEVELS if record.levelno >= number), "debug")
            fields: dict[str, Any] = {"source": record.name, "message": record.getMessage()}
            if record.exc_info and record.exc_info[1] is not None:
                fields["error"] = f"{type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
            getattr(self._logger, level)("otel_sdk", **fields)
        except Exception:  # a log record must never break the SDK's thread
            self.handleError(record)


def _text(value: str) -> str:
    """A span attribute or name from the client or the upstream: the log line's cut and escaping."""
    return clean_text(value)


class Tracing:
    """The tracer provider, its exporter, and the span work of `Books` (begin, inject, end)."""

    def __init__(self, endpoint: str, *, timeout: float = 10.0, logger: Any = None) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import SpanLimits, TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._server = SpanKind.SERVER
        self._status, self._error = Status, StatusCode.ERROR
        self._in_context = set_span_in_context
        # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES (pod name, namespace...).
        resource = Resource.create({"service.name": "streamwarden", "service.version": __version__})
        own_limit = not any(os.environ.get(name) for name in _LIMIT_VARIABLES)
        limits = SpanLimits(max_attribute_length=MAX_ATTRIBUTE_LENGTH if own_limit else None)
        self._logger = logger
        self._bridge: SdkLogBridge | None = None
        if logger is not None:
            self._bridge = SdkLogBridge(logger)
            sdk_logger = logging.getLogger("opentelemetry")
            sdk_logger.addHandler(self._bridge)
            sdk_logger.propagate = False  # (the root logger is the application's, not the SDK's)
        # shutdown_on_exit=False: no atexit flush on the SDK's own timeouts; `close` does it, bounded.
        self.provider = TracerProvider(resource=resource, span_limits=limits, shutdown_on_exit=False)
        self.exporter = OTLPSpanExporter(endpoint=traces_url(endpoint), timeout=timeout)
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("streamwarden", __version__)
        self.propagator = TraceContextTextMapPropagator()

    def begin(self, ex: ExchangeRecord, headers: Mapping[str, str] | None) -> None:
        parent = None
        if headers is not None and "traceparent" in headers:
            parent = self.propagator.extract({name: headers[name] for name in _TRACE_HEADERS if name in headers})
        operation = OPERATIONS.get(ex.api)
        attributes: dict[str, Any] = {
            "http.request.method": _text(ex.method), "url.path": _text(ex.path), "streamwarden.api": ex.api,
        }
        if operation is not None:
            attributes["gen_ai.operation.name"] = operation
        method_name = ex.method if ex.method.isalpha() and len(ex.method) <= 16 else "HTTP"  # "-": a refused connection
        ex.span = self.tracer.start_span(
            operation or method_name,
            context=parent,
            kind=self._server,
            attributes=attributes,
            start_time=_wall_ns(ex.started),
        )

    def inject(self, ex: ExchangeRecord, headers: MutableMapping[str, str]) -> None:
        """The proxy's span becomes the upstream's parent; the client's own context is not passed on."""
        for name in _TRACE_HEADERS:
            if name in headers:
                del headers[name]  # every copy of it
        if ex.span is not None:
            carrier: dict[str, str] = {}
            self.propagator.inject(carrier, context=self._in_context(ex.span))
            headers.update(carrier)

    def end(self, ex: ExchangeRecord, outcome: str, reason: str, abort_phase: str | None) -> None:
        span = ex.span
        ex.span = None
        operation = OPERATIONS.get(ex.api)
        if operation is not None:
            model = _text(ex.model) if ex.model else None
            span.update_name(f"{operation} {model}" if model else operation)
            if model:
                span.set_attribute("gen_ai.request.model", model)
            span.set_attribute("gen_ai.request.stream", ex.stream)
            if ex.response_model:
                span.set_attribute("gen_ai.response.model", _text(ex.response_model))
            if ex.prompt_tokens is not None:
                span.set_attribute("gen_ai.usage.input_tokens", ex.prompt_tokens)
            if ex.completion_tokens is not None:
                span.set_attribute("gen_ai.usage.output_tokens", ex.completion_tokens)
            if ex.finish_reasons:
                reasons = [_text(reason) for reason in ex.finish_reasons[:MAX_FINISH_REASONS]]
                span.set_attribute("gen_ai.response.finish_reasons", reasons)
        span.set_attribute("streamwarden.outcome", outcome)
        span.set_attribute("streamwarden.reason", reason)
        if ex.status is not None:
            span.set_attribute("http.response.status_code", ex.status)
        if abort_phase is not None:
            span.set_attribute("streamwarden.abort_phase", abort_phase)
        if outcome != "ok":
            span.set_attribute("error.type", reason)
        if outcome == "error":
            span.set_status(self._status(self._error, reason))
        if ex.first_content_at is not None:
            span.add_event("first_token", timestamp=_wall_ns(ex.first_content_at))
        for rewrite in ex.rewrites:  # the guard does not time its rewrites: they are stamped at the end
            span.add_event("rewrite", {"streamwarden.rewrite.reason": str(rewrite)})
        span.end()

    def flush(self, timeout_ms: int = 10_000) -> bool:
        return bool(self.provider.force_flush(timeout_ms))

    def close(self, timeout: float = 5.0) -> bool:
        """Flush and shut the SDK down within `timeout` seconds, whatever the collector does.

        The SDK's shutdown waits for its export (the exporter's timeout, then retries): it runs in a
        daemon thread that is left behind when the time is up, so the process can exit on time.
        False when the time ran out (the spans still queued are lost, and that is logged).
        """
        done = threading.Event()

        def shut_down() -> None:
            try:
                self.provider.shutdown()
            finally:
                done.set()

        threading.Thread(target=shut_down, name="streamwarden-tracing-close", daemon=True).start()
        finished = done.wait(max(0.0, timeout))
        if not finished and self._logger is not None:
            self._logger.warning("tracing_flush_timeout", timeout_s=round(timeout, 3),
                                 why="the collector did not take the last spans in time: they are dropped")
        if finished and self._bridge is not None:  # (else the thread left behind may still log)
            sdk_logger = logging.getLogger("opentelemetry")
            sdk_logger.removeHandler(self._bridge)
            sdk_logger.propagate = not sdk_logger.handlers
            self._bridge = None
        return finished
