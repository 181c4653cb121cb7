"""The verdict's vocabulary: an exchange's phases, outcomes, reasons and cancellations, the status the
proxy answers each reason with, and the reason an upstream's own status is. A leaf, so that the record
and the lifecycle both read it."""

from __future__ import annotations

from enum import StrEnum
from types import MappingProxyType

__all__ = ["HOOKED_CANCELLATIONS", "REASONS", "Cancellation", "Outcome", "Phase", "Reason", "Rewrite",
           "reason_for_status", "status_for"]


class Phase(StrEnum):
    RECEIVED = "received"
    AWAITING_HEADERS = "awaiting_headers"
    STREAMING = "streaming"
    RESPONDING_WHOLE = "responding_whole"
    FINISHED = "finished"


class Outcome(StrEnum):
    OK = "ok"
    ERROR = "error"
    ABORTED = "aborted"


class Reason(StrEnum):
    """The `reason` label values, fixed (the README's metrics table)."""

    COMPLETE = "complete"
    UPSTREAM_4XX = "upstream_4xx"
    UPSTREAM_5XX = "upstream_5xx"
    CONNECT_FAILED = "connect_failed"
    FIRST_BYTE_TIMEOUT = "first_byte_timeout"
    STALL_TIMEOUT = "stall_timeout"
    STREAM_CUT = "stream_cut"
    STRAY_HTTP_BLOCK = "stray_http_block"
    UPSTREAM_ERROR_FRAME = "upstream_error_frame"
    INVALID_UPSTREAM_BODY = "invalid_upstream_body"
    INCOMPLETE_BATCH = "incomplete_batch"
    BODY_TOO_LARGE = "body_too_large"
    SHUTDOWN = "shutdown"
    PROXY_ERROR = "proxy_error"
    BAD_REQUEST = "bad_request"
    BAD_UPSTREAM_RESPONSE = "bad_upstream_response"
    UPSTREAM_ABORTED = "upstream_aborted"
    PROXY_OVERLOADED = "proxy_overloaded"
    CLIENT_TIMEOUT = "client_timeout"
    CLIENT_DISCONNECT = "client_disconnect"
    CLIENT_STALLED = "client_stalled"


# reason -> (outcome, the HTTP status the proxy gives it when it answers itself; 0: the upstream's own)
REASONS: MappingProxyType[Reason, tuple[Outcome, int]] = MappingProxyType({
    Reason.COMPLETE: (Outcome.OK, 0),
    Reason.UPSTREAM_4XX: (Outcome.ERROR, 0),
    Reason.UPSTREAM_5XX: (Outcome.ERROR, 0),
    Reason.CONNECT_FAILED: (Outcome.ERROR, 502),
    Reason.FIRST_BYTE_TIMEOUT: (Outcome.ERROR, 504),
    Reason.STALL_TIMEOUT: (Outcome.ERROR, 504),
    Reason.STREAM_CUT: (Outcome.ERROR, 502),
    Reason.STRAY_HTTP_BLOCK: (Outcome.ERROR, 502),
    Reason.UPSTREAM_ERROR_FRAME: (Outcome.ERROR, 502),
    Reason.INVALID_UPSTREAM_BODY: (Outcome.ERROR, 502),
    Reason.INCOMPLETE_BATCH: (Outcome.ERROR, 502),
    Reason.BODY_TOO_LARGE: (Outcome.ERROR, 413),
    Reason.SHUTDOWN: (Outcome.ERROR, 503),
    Reason.PROXY_ERROR: (Outcome.ERROR, 500),
    Reason.BAD_REQUEST: (Outcome.ERROR, 400),
    Reason.BAD_UPSTREAM_RESPONSE: (Outcome.ERROR, 502),
    Reason.UPSTREAM_ABORTED: (Outcome.ERROR, 502),
    Reason.PROXY_OVERLOADED: (Outcome.ERROR, 503),
    Reason.CLIENT_TIMEOUT: (Outcome.ERROR, 408),
    Reason.CLIENT_DISCONNECT: (Outcome.ABORTED, 0),
    Reason.CLIENT_STALLED: (Outcome.ABORTED, 0),
})



class Rewrite(StrEnum):
    """A change the stream guard made to what the upstream sent: the `reason` label of the rewrites
    metric, the log line's `rewrites`, a span's `rewrite` events."""

    STRAY_HTTP_BLOCK = "stray_http_block"
    FOREIGN_ERROR_FRAME = "foreign_error_frame"
    MISSING_TERMINAL = "missing_terminal"
    STREAM_CUT = "stream_cut"
    STALL_TIMEOUT = "stall_timeout"
    SHUTDOWN = "shutdown"
    MALFORMED_EVENT = "malformed_event"
    OVERSIZED_EVENT = "oversized_event"
    LATE_COMMIT_STATUS = "late_commit_status"
    UPSTREAM_ABORTED = "upstream_aborted"


class Cancellation(StrEnum):
    """Why the proxy cancelled upstream work: the `reason` label of the cancellations metric.

    The client's leaving and an upstream failure the proxy reacts to by closing the upstream name
    themselves; any other error the proxy ended a stream with is `upstream_error`. `cancel_hook`
    counts each --cancel-hook call made, besides the close counted under one of the others.
    """

    CLIENT_DISCONNECT = "client_disconnect"
    CLIENT_STALLED = "client_stalled"
    STALL_TIMEOUT = "stall_timeout"
    FIRST_BYTE_TIMEOUT = "first_byte_timeout"
    SHUTDOWN = "shutdown"
    UPSTREAM_ERROR = "upstream_error"
    CANCEL_HOOK = "cancel_hook"


# Cancellations a --cancel-hook follows up: the proxy gave up on work the upstream may still be doing.
# Not `upstream_error`: the upstream itself ended that request.
HOOKED_CANCELLATIONS = frozenset({
    Cancellation.CLIENT_DISCONNECT, Cancellation.CLIENT_STALLED, Cancellation.STALL_TIMEOUT,
    Cancellation.FIRST_BYTE_TIMEOUT, Cancellation.SHUTDOWN,
})


def status_for(reason: Reason) -> int:
    """The HTTP status of a verdict the proxy answers itself (docs/failures.md)."""
    return REASONS[reason][1] or 502


def reason_for_status(status: int) -> Reason:
    """The verdict on a response the upstream ended with its own status (its body judged no further)."""
    if status >= 500:
        return Reason.UPSTREAM_5XX
    if status >= 400:
        return Reason.UPSTREAM_4XX
    return Reason.COMPLETE
