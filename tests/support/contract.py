"""The metrics contract of design sections 3, 7 and 10, written out once for the tests.

Kept apart from `proxy.observe.metrics` on purpose: the tests check the code against the design, so their
tables must not come from the code.
"""

from __future__ import annotations

METRICS: dict[str, tuple[str, frozenset[str]]] = {
    "streamwarden_requests_total": ("counter", frozenset({"api", "model", "outcome", "reason"})),
    "streamwarden_request_duration_seconds": ("histogram", frozenset({"api", "outcome"})),
    "streamwarden_time_to_first_token_seconds": ("histogram", frozenset({"api", "model"})),
    "streamwarden_inflight_requests": ("gauge", frozenset({"api"})),
    "streamwarden_upstream_responses_total": ("counter", frozenset({"api", "code"})),
    "streamwarden_upstream_cancellations_total": ("counter", frozenset({"api", "reason"})),
    "streamwarden_stream_rewrites_total": ("counter", frozenset({"api", "reason"})),
    "streamwarden_tokens_total": ("counter", frozenset({"api", "model", "kind", "source"})),
    "streamwarden_upstream_up": ("gauge", frozenset()),
    "streamwarden_build_info": ("gauge", frozenset({"version"})),
    "streamwarden_inter_token_latency_seconds": ("histogram", frozenset({"api"})),
    "streamwarden_time_per_output_token_seconds": ("histogram", frozenset({"api"})),
    "streamwarden_aborts_total": ("counter", frozenset({"api", "phase"})),
    "streamwarden_abort_wait_seconds": ("histogram", frozenset({"api"})),
    # --cancel-hook calls that failed
    "streamwarden_cancel_hook_failures_total": ("counter", frozenset({"api", "reason"})),
    # --resume-on-cut
    "streamwarden_stream_resumes_total": ("counter", frozenset({"api", "reason", "result"})),
}
APIS = frozenset({"chat_completions", "completions", "responses", "messages", "embeddings", "models", "other"})
OUTCOMES = frozenset({"ok", "error", "aborted"})
REASONS = {
    "ok": frozenset({"complete"}),
    "error": frozenset({
        "upstream_4xx", "upstream_5xx", "connect_failed", "first_byte_timeout", "stall_timeout", "stream_cut",
        "stray_http_block", "upstream_error_frame", "invalid_upstream_body", "incomplete_batch",
        "body_too_large", "shutdown", "proxy_error", "upstream_aborted",
        # wave 2 (design section 3)
        "bad_request", "bad_upstream_response", "proxy_overloaded", "client_timeout",
    }),
    "aborted": frozenset({"client_disconnect", "client_stalled"}),
}  # fmt: skip
REQUEST_REASONS = frozenset().union(*REASONS.values())
CANCELLATION_REASONS = frozenset({
    "client_disconnect", "client_stalled", "stall_timeout", "first_byte_timeout", "shutdown", "upstream_error",
    "cancel_hook",
})  # fmt: skip
CANCEL_HOOK_FAILURE_REASONS = frozenset({
    "timeout", "connect_failed", "http_status", "invalid_body", "invalid_id", "dropped", "cut", "error",
})
REWRITE_REASONS = frozenset({
    "stray_http_block", "foreign_error_frame", "missing_terminal", "stream_cut", "stall_timeout", "shutdown",
    "malformed_event", "oversized_event", "late_commit_status", "upstream_aborted",
})  # fmt: skip
ABORT_PHASES = frozenset({"before_headers", "before_first_token", "mid_stream", "whole_body"})
KINDS = frozenset({"prompt", "completion"})
SOURCES = frozenset({"usage", "estimated"})
RESUME_APIS = frozenset({"chat_completions", "completions"})
RESUME_REASONS = frozenset({"stream_cut", "stall_timeout", "stray_http_block", "upstream_error_frame"})
RESUME_RESULTS = frozenset({"resumed", "refused", "failed"})
