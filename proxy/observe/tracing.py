"""OpenTelemetry traces (the optional extra `streamwarden[otel]`): one server span per exchange.

The SDK is imported only when an OTLP endpoint is configured (`Tracing()`), so a proxy without the
extra or the endpoint pays nothing but one `is None` check per exchange. The span follows the GenAI
semantic conventions (named `{gen_ai.operation.name} {gen_ai.request.model}`), continues the client's
W3C `traceparent` / `tracestate`, and its own context is what goes upstream, so a vLLM started with
`--otlp-traces-endpoint` hangs its spans under the proxy's. Spans leave through the SDK's batch
processor (a thread of its own) and its standard OTLP/HTTP protobuf exporter; the event loop never
waits for a collector.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, MutableMapping
from typing import Any

from proxy import __version__
from proxy.config import otel_installed
from proxy.core.record import ExchangeRecord

__all__ = ["OPERATIONS", "Tracing", "otel_installed", "traces_url"]

# gen_ai.operation.name by dialect; the rest (models, other) are plain HTTP spans.
OPERATIONS = {
    "chat_completions": "chat",
    "responses": "chat",
    "messages": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
}
_TRACE_HEADERS = ("traceparent", "tracestate")


def traces_url(endpoint: str) -> str:
    """OTEL_EXPORTER_OTLP_ENDPOINT is a base URL: OTLP/HTTP traces go to its `/v1/traces`."""
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


def _wall_ns(monotonic: float) -> int:
    """A `time.monotonic()` instant as the wall-clock nanoseconds spans are stamped with."""
    return time.time_ns() - int((time.monotonic() - monotonic) * 1e9)


class Tracing:
    """The tracer provider, its exporter, and the span work of `Books` (begin, inject, end)."""

    def __init__(self, endpoint: str, *, timeout: float = 10.0) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._server = SpanKind.SERVER
        self._status, self._error = Status, StatusCode.ERROR
        self._in_context = set_span_in_context
        # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES (pod name, namespace...).
        resource = Resource.create({"service.name": "streamwarden", "service.version": __version__})
        self.provider = TracerProvider(resource=resource)
        self.exporter = OTLPSpanExporter(endpoint=traces_url(endpoint), timeout=timeout)
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("streamwarden", __version__)
        self.propagator = TraceContextTextMapPropagator()

    def begin(self, ex: ExchangeRecord, headers: Mapping[str, str] | None) -> None:
        parent = None
        if headers is not None and "traceparent" in headers:
            parent = self.propagator.extract({name: headers[name] for name in _TRACE_HEADERS if name in headers})
        operation = OPERATIONS.get(ex.api)
        attributes: dict[str, Any] = {"http.request.method": ex.method, "url.path": ex.path, "streamwarden.api": ex.api}
        if operation is not None:
            attributes["gen_ai.operation.name"] = operation
        ex.span = self.tracer.start_span(
            operation or (ex.method if ex.method.isalpha() else "HTTP"),  # "-": a refused connection
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
            span.update_name(f"{operation} {ex.model}" if ex.model else operation)
            if ex.model:
                span.set_attribute("gen_ai.request.model", ex.model)
            span.set_attribute("gen_ai.request.stream", ex.stream)
            if ex.response_model:
                span.set_attribute("gen_ai.response.model", ex.response_model)
            if ex.prompt_tokens is not None:
                span.set_attribute("gen_ai.usage.input_tokens", ex.prompt_tokens)
            if ex.completion_tokens is not None:
                span.set_attribute("gen_ai.usage.output_tokens", ex.completion_tokens)
            if ex.finish_reasons:
                span.set_attribute("gen_ai.response.finish_reasons", list(ex.finish_reasons))
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
            span.add_event("rewrite", {"streamwarden.rewrite.reason": rewrite})
        span.end()

    def flush(self, timeout_ms: int = 10_000) -> bool:
        return bool(self.provider.force_flush(timeout_ms))

    def close(self) -> None:
        self.provider.shutdown()
