"""What one exchange did: the record the exchange fills in and the books turn into metrics, one log
line and (with tracing on) one span. Plain data, so the lifecycle can write its verdict into it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from proxy.core.dialects import Usage
from proxy.core.latency import TokenGaps
from proxy.core.verdicts import Cancellation, Outcome, Phase, Reason, Rewrite

if TYPE_CHECKING:
    from proxy.core.resume import Resumer

__all__ = ["ExchangeRecord"]


@dataclass(slots=True)
class ExchangeRecord:
    """What one request did; the fields of the `request` log line."""

    request_id: str
    method: str
    path: str
    api: str
    client: str | None
    started: float = field(default_factory=time.monotonic)
    phase: Phase = Phase.RECEIVED  # the lifecycle's phase; once finished, the one its verdict was taken in
    model: str | None = None
    stream: bool = False
    status: int | None = None
    upstream_status: int | None = None
    outcome: Outcome | None = None
    reason: Reason | None = None
    first_content_at: float | None = None
    events: int = 0
    content_events: int = 0
    bytes_out: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    upstream_cancelled: Cancellation | None = None  # cancellation reason, when the proxy cancelled the upstream
    rewrites: list[Rewrite] = field(default_factory=list)
    drained: bool = False  # --on-abandon drain read the upstream to its end after the client left
    client_request_id: str | None = None  # a client's X-Request-Id that was not usable as given
    body_reserved: int = 0  # request-body bytes this exchange holds against --max-buffered-body-bytes
    settled_at: float | None = None  # when the verdict was fixed: the moment of an abort, even if a drain follows
    gaps: TokenGaps | None = None  # content-event times of a stream, from its first forwarded content on
    response_model: str | None = None  # the model the upstream says answered
    upstream_message: str | None = None  # the upstream's own error message, for the log line
    cause: str | None = None  # why the way to the upstream failed (the OS error, the deadline), for the log line
    finish_reasons: tuple[str, ...] = ()
    booked: bool = False  # its metrics and log line are written
    span: Any = None  # the OpenTelemetry span, when tracing is on
    resumer: Resumer | None = None  # --resume-on-cut: the stream's continuations and decisions

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
