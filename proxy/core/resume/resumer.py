"""One exchange's resume budget and its decisions: the guard asks, the shell carries out.

The guard calls `may_resume(reason, status)` where a committed stream would end with an error; a
yes means the shell sends `body()` upstream and, when a stream answers, hands the guard
`started()`'s stitcher; otherwise it calls `failed()` and the guard ends as it would have. Every
break of a stream a continuation could mend is one decision in `decisions` (the
`streamwarden_stream_resumes_total{reason, result}` counts): `resumed`, `refused` (the request, the
answer so far or the limit rule it out) or `failed` (the continuation was answered with an error or
no answer).
"""

from __future__ import annotations

from typing import Any

from proxy.core.dialects import DialectStream
from proxy.core.dialects.chat import ChatStream
from proxy.core.resume.rules import (
    RESUMABLE_REASONS,
    RETRYABLE_STATUSES,
    Refusal,
    continuation_body,
    cut_refusal,
    parse_request,
)
from proxy.core.resume.stitch import Stitcher
from proxy.core.resume.transcript import Transcript

__all__ = ["RESULTS", "Resumer"]

RESULTS = ("resumed", "refused", "failed")
_STATUSED = frozenset({"stray_http_block", "upstream_error_frame"})  # continued only when retryable


class Resumer:
    """Decides, for one streamed exchange, whether each break is continued (at most `limit` times)."""

    __slots__ = ("_api", "_obj", "_reason", "decisions", "limit", "refusal", "resumes", "transcript")

    def __init__(self, api: str, body: bytes | bytearray, limit: int) -> None:
        self._api = api
        self.limit = limit
        self.transcript = Transcript()
        self.resumes = 0  # continuations that answered with a stream
        self.decisions: list[tuple[str, str]] = []  # (reason, result), in order
        self.refusal: str | None = None  # why the last break was not continued
        self._reason: str | None = None  # the break being mended
        self._obj: dict[str, Any] | None = None
        try:
            self._obj = parse_request(api, body)
        except Refusal as exc:
            self.refusal = str(exc)

    @property
    def possible(self) -> bool:
        """The request itself allows continuations (else the guard need not ask, nor record)."""
        return self._obj is not None and self.limit > 0

    def watch(self, stream: DialectStream) -> None:
        """Keep the transcript from the chunks this stream's dialect parses."""
        if isinstance(stream, ChatStream):
            stream.recorder = self.transcript.note

    def may_resume(self, reason: str, status: int) -> bool:
        """The guard's question: continue this break? A no for a break of the resumable kinds is counted."""
        if reason not in RESUMABLE_REASONS or (reason in _STATUSED and status not in RETRYABLE_STATUSES):
            return False
        if self._obj is None:
            return self._refuse(reason, self.refusal or "the request cannot be continued")
        attempts = sum(1 for _, result in self.decisions if result != "refused")
        if attempts >= self.limit:
            return self._refuse(reason, f"the limit of {self.limit} continuations was reached")
        try:
            cut_refusal(self._obj, self.transcript)
        except Refusal as exc:
            return self._refuse(reason, str(exc))
        self._reason = reason
        return True

    def body(self) -> bytes:
        """The continuation request's body (after a yes)."""
        assert self._obj is not None
        assert self._reason is not None
        return continuation_body(self._api, self._obj, self.transcript)

    def started(self) -> Stitcher:
        """The continuation answered with a stream: its events go through this stitcher."""
        assert self._reason is not None
        self.decisions.append((self._reason, "resumed"))
        self.resumes += 1
        self._reason = None
        return Stitcher(self.transcript)

    def failed(self, why: str) -> None:
        """The continuation was answered with an error or not at all: the stream ends as it broke."""
        assert self._reason is not None
        self.decisions.append((self._reason, "failed"))
        self.refusal = why
        self._reason = None

    def withdraw(self, why: str) -> None:
        """After a yes, no continuation can be sent after all (the upstream asked to wait too long)."""
        assert self._reason is not None
        self._refuse(self._reason, why)
        self._reason = None

    def _refuse(self, reason: str, why: str) -> bool:
        self.decisions.append((reason, "refused"))
        self.refusal = why
        return False
