"""One exchange's resume budget and its decisions: the guard asks, the shell carries out.

The guard calls `may_resume(reason, status)` where a committed stream would end with an error; a
yes means the shell sends `body()` upstream (first, where `count_request()` asks, the backend's
`/tokenize`, whose answer goes to `counted()`) and, when a stream answers, hands the guard
`started()`'s stitcher; otherwise it calls `failed()` and the guard ends as it would have. Each
continuation sent is counted once in `decisions` (the `streamwarden_stream_resumes_total{reason,
result}` counts): `resumed` when it carried the stream on, `failed` when it was answered with an
error or none, or broke or errored in turn; a break of the first stream for which none was sent is
`refused` (the request, the answer so far or the limit ruled it out).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from proxy.core.dialects import DialectStream
from proxy.core.dialects.chat import ChatStream
from proxy.core.resume.count import answer_limit, read_count, tokenize_body
from proxy.core.resume.rules import (
    BUDGETS,
    RESUMABLE_REASONS,
    RETRYABLE_STATUSES,
    Refusal,
    continuation_body,
    cut_refusal,
    parse_request,
)
from proxy.core.resume.stitch import Stitcher
from proxy.core.resume.transcript import Transcript
from proxy.core.verdicts import Reason

__all__ = ["RESULTS", "ResumeResult", "Resumer"]


class ResumeResult(StrEnum):
    """What came of a break: the `result` label of the resumes metric."""

    RESUMED = "resumed"
    REFUSED = "refused"
    FAILED = "failed"


RESULTS = tuple(ResumeResult)
_STATUSED = frozenset({Reason.STRAY_HTTP_BLOCK, Reason.UPSTREAM_ERROR_FRAME})  # continued only when retryable


def _rule_fields(obj: dict[str, Any]) -> dict[str, Any]:
    """What `cut_refusal` reads of a request: its budgets, and whether its prompt is token ids."""
    fields = {key: obj[key] for key in (*BUDGETS, "min_tokens") if key in obj}
    prompt = obj.get("prompt")
    if type(prompt) is list:
        fields["prompt"] = prompt[:1] if not (len(prompt) == 1 and type(prompt[0]) is list) else [prompt[0][:1]]
    return fields


def _counts_matter(obj: dict[str, Any]) -> bool:
    """The tokens so far change what the continuation or the client is told: a budget to lower, or
    the usage chunk the client asked for."""
    options = obj.get("stream_options")
    usage = type(options) is dict and options.get("include_usage") is True
    return usage or any(type(obj.get(key)) is int for key in (*BUDGETS, "min_tokens"))


class Resumer:
    """Decides, for one streamed exchange, whether each break is continued (at most `limit` times)."""

    __slots__ = ("_api", "_body", "_booked", "_counts", "_fields", "_max_size", "_model", "_next", "_reason",
                 "_running", "limit", "refusal", "resumes", "transcript")

    def __init__(self, api: str, body: bytes | bytearray, limit: int, max_size: int | None = None) -> None:
        self._api = api
        self._max_size = max_size  # --max-body-size: no continuation is sent past it
        self._next: bytes | None = None  # the continuation's body, built when one is due
        self.limit = limit
        self.transcript = Transcript()
        self.resumes = 0  # continuations that answered with a stream
        self._booked: list[tuple[Reason, ResumeResult]] = []  # (reason, result), in order
        self._running: Reason | None = None  # the break the streaming continuation mends (booked at its end)
        self.refusal: str | None = None  # why the last break was not continued
        self._reason: Reason | None = None  # the break being mended
        # The client's bytes (held for the send anyway), parsed again only when a continuation is due:
        # a body of many small objects is ~20 times its size as Python objects.
        self._body = bytes(body)
        self._fields: dict[str, Any] | None = None  # the few fields a break's refusal rules read
        self._counts = False  # the tokens so far must be counted, not guessed (see `count_request`)
        self._model: object = None
        try:
            obj = parse_request(api, self._body)
            self._fields, self._counts, self._model = _rule_fields(obj), _counts_matter(obj), obj.get("model")
        except Refusal as exc:
            self.refusal = str(exc)
            self._body = b""

    @property
    def possible(self) -> bool:
        """The request itself allows continuations (else the guard need not ask, nor record)."""
        return self._fields is not None and self.limit > 0

    @property
    def decisions(self) -> list[tuple[Reason, ResumeResult]]:
        """One (reason, result) per break of the first stream not mended, and per continuation sent:
        a continuation still streaming (or that ended without breaking) counts `resumed`."""
        if self._running is None:
            return list(self._booked)
        return [*self._booked, (self._running, ResumeResult.RESUMED)]

    def watch(self, stream: DialectStream) -> None:
        """Keep the transcript from the chunks this stream's dialect parses."""
        if isinstance(stream, ChatStream):
            stream.recorder = self.transcript.note

    def may_resume(self, reason: Reason, status: int) -> bool:
        """The guard's question: continue this break? A no for a break of the resumable kinds is counted."""
        if self._running is not None and reason is not Reason.SHUTDOWN:  # the continuation itself broke or errored
            self._booked.append((self._running, ResumeResult.FAILED))
            self._running = None
            self.refusal = f"the continuation broke ({reason})"
            broke_again = True
        else:
            broke_again = False
        if reason not in RESUMABLE_REASONS or (reason in _STATUSED and status not in RETRYABLE_STATUSES):
            return False
        if self._fields is None:
            return self._refuse(reason, self.refusal or "the request cannot be continued")
        attempts = sum(1 for _, result in self._booked if result is not ResumeResult.REFUSED)
        if attempts >= self.limit:
            why = f"the limit of {self.limit} continuations was reached"
            if broke_again:  # (booked once, as the continuation that broke: none more was sent)
                self.refusal = why
                return False
            return self._refuse(reason, why)
        self._next = None
        try:
            cut_refusal(self._fields, self.transcript)
            self._build()  # (uncounted: with the chunks' count, a lower bound, built again once counted)
        except Refusal as exc:
            return self._refuse(reason, str(exc))
        self._reason = reason
        return True

    @property
    def _uncounted(self) -> bool:
        return self._counts and not self.transcript.counted

    def _build(self) -> None:
        self._next = continuation_body(
            self._api, parse_request(self._api, self._body), self.transcript, self._body, self._max_size
        )

    def count_request(self) -> tuple[bytes, int] | None:
        """After a yes: the `/tokenize` body the shell must send first, and the most bytes of its answer
        to read; None when the stream's own count stands (token ids, per-chunk usage) or none matters."""
        assert self._reason is not None
        if not self._uncounted:
            return None
        text = self.transcript.text
        return tokenize_body(self._model, text), answer_limit(text)

    def counted(self, status: int, answer: bytes) -> bool:
        """`/tokenize`'s answer: True when it counted the text (the continuation is built), else the
        break is refused: without a count the continuation could ask for more than the budget left."""
        assert self._reason is not None
        text = self.transcript.text
        try:
            self.transcript.tokenized = (len(text), read_count(status, answer, text))
            self._build()
        except Refusal as exc:
            self.uncounted(str(exc))
            return False
        return True

    def uncounted(self, why: str) -> None:
        """`/tokenize` was not answered (cut, too slow, too long): the break is refused."""
        assert self._reason is not None
        self._refuse(self._reason, why)
        self._reason = None

    def body(self) -> bytes:
        """The continuation request's body (after a yes, and after `counted()` where it was asked)."""
        assert self._reason is not None
        assert self._next is not None
        return self._next

    def started(self) -> Stitcher:
        """The continuation answered with a stream: its events go through this stitcher."""
        assert self._reason is not None
        self._running = self._reason  # booked `resumed` unless it breaks in turn
        self._next = None
        self.resumes += 1
        self._reason = None
        return Stitcher(self.transcript)

    def failed(self, why: str) -> None:
        """The continuation was answered with an error or not at all: the stream ends as it broke."""
        assert self._reason is not None
        self._booked.append((self._reason, ResumeResult.FAILED))
        self.refusal = why
        self._reason = None

    def withdraw(self, why: str) -> None:
        """After a yes, no continuation can be sent after all (the upstream asked to wait too long)."""
        assert self._reason is not None
        self._refuse(self._reason, why)
        self._reason = None

    def _refuse(self, reason: Reason, why: str) -> bool:
        self._booked.append((reason, ResumeResult.REFUSED))
        self.refusal = why
        return False
