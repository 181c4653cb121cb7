"""What one exchange did: the record the exchange fills in and the books turn into metrics, one log
line and (with tracing on) one span. Plain data, so the lifecycle can write its verdict into it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from proxy.core.dialects import Usage
from proxy.core.latency import TokenGaps
from proxy.core.verdicts import Cancellation, Outcome, Phase, Reason, Rewrite

if TYPE_CHECKING:
    from proxy.core.resume import Resumer

__all__ = ["ExchangeRecord"]


class ExchangeRecord:
    """What one request did; the fields of the `request` log line."""

    # (A plain class with its own `__init__`, not a dataclass: made once per request, and compiled, a
    # dataclass's generated `__init__` runs as interpreted code, several times the work of this one.)
    __slots__ = ("api", "body_reserved", "booked", "bytes_out", "cause", "client", "client_request_id",
                 "completion_tokens", "content_events", "drained", "events", "finish_reasons", "first_content_at",
                 "gaps", "method", "model", "outcome", "path", "phase", "prompt_tokens", "reason", "request_id",
                 "response_model", "resumer", "rewrites", "settled_at", "span", "started", "status", "stream",
                 "upstream_cancelled", "upstream_message", "upstream_status")  # fmt: skip

    request_id: str
    method: str
    path: str
    api: str
    client: str | None
    started: float
    phase: Phase  # the lifecycle's phase; once finished, the one its verdict was taken in
    model: str | None
    stream: bool
    status: int | None
    upstream_status: int | None
    outcome: Outcome | None
    reason: Reason | None
    first_content_at: float | None
    events: int
    content_events: int
    bytes_out: int
    prompt_tokens: int | None
    completion_tokens: int | None
    upstream_cancelled: Cancellation | None  # cancellation reason, when the proxy cancelled the upstream
    rewrites: list[Rewrite]
    drained: bool  # --on-abandon drain read the upstream to its end after the client left
    client_request_id: str | None  # a client's X-Request-Id that was not usable as given
    body_reserved: int  # request-body bytes this exchange holds against --max-buffered-body-bytes
    settled_at: float | None  # when the verdict was fixed: the moment of an abort, even if a drain follows
    gaps: TokenGaps | None  # content-event times of a stream, from its first forwarded content on
    response_model: str | None  # the model the upstream says answered
    upstream_message: str | None  # the upstream's own error message, for the log line
    cause: str | None  # why the way to the upstream failed (the OS error, the deadline), for the log line
    finish_reasons: tuple[str, ...]
    booked: bool  # its metrics and log line are written
    span: Any  # the OpenTelemetry span, when tracing is on
    resumer: Resumer | None  # --resume-on-cut: the stream's continuations and decisions

    def __init__(self, request_id: str, method: str, path: str, api: str, client: str | None) -> None:
        self.request_id = request_id
        self.method = method
        self.path = path
        self.api = api
        self.client = client
        self.started = time.monotonic()
        self.phase = Phase.RECEIVED
        self.model = None
        self.stream = False
        self.status = None
        self.upstream_status = None
        self.outcome = None
        self.reason = None
        self.first_content_at = None
        self.events = 0
        self.content_events = 0
        self.bytes_out = 0
        self.prompt_tokens = None
        self.completion_tokens = None
        self.upstream_cancelled = None
        self.rewrites = []
        self.drained = False
        self.client_request_id = None
        self.body_reserved = 0
        self.settled_at = None
        self.gaps = None
        self.response_model = None
        self.upstream_message = None
        self.cause = None
        self.finish_reasons = ()
        self.booked = False
        self.span = None
        self.resumer = None

    def record_usage(self, usage: Usage | None) -> None:
        """The upstream's own token counts (when it gave them), and which model answered and why it stopped."""
        if usage is not None:
            self.prompt_tokens, self.completion_tokens = usage.prompt_tokens, usage.completion_tokens
            self.response_model = usage.model or self.response_model
            self.finish_reasons = usage.finish_reasons or self.finish_reasons

    def note_content(self, now: float, events: int) -> None:
        """The stream loop forwarded `events` content-bearing events at monotonic time `now`."""
        gaps = self.gaps
        if gaps is None:
            gaps = self.gaps = TokenGaps()
        gaps.note(now, events)
