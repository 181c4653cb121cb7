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
from typing import Any, Final

from proxy.core.dialects import DialectStream
from proxy.core.dialects.chat import ChatStream
from proxy.core.resume.count import answer_limit, read_count, tokenize_body
from proxy.core.resume.rules import (
    BUDGETS,
    RESUMABLE_REASONS,
    RETRYABLE_STATUSES,
    Refusal,
    checked_request,
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
_PARSE: Final = object()  # (Resumer's default: the body is parsed by the Resumer itself)
_STATUSED = frozenset({Reason.STRAY_HTTP_BLOCK, Reason.UPSTREAM_ERROR_FRAME})  # continued only when retryable


def _rule_fields(obj: dict[str, Any]) -> dict[str, Any]:
    """What `cut_refusal` reads of a request: its budgets, and whether its prompt is token ids."""
    fields = {key: obj[key] for key in (*BUDGETS, "min_tokens") if key in obj}
    prompt = obj.get("prompt")
    if type(prompt) is list:
        fields["prompt"] = prompt[:1] if not (len(prompt) == 1 and type(prompt[0]) is list) else [prompt[0][:1]]
    return fields


def _budgeted(obj: dict[str, Any]) -> bool:
    """The tokens so far change what the continuation asks: a budget to lower."""
    return any(type(obj.get(key)) is int for key in (*BUDGETS, "min_tokens"))


def _counts_matter(obj: dict[str, Any]) -> bool:
    """The tokens so far change what the continuation or the client is told: a budget to lower, or
    the usage chunk the client asked for."""
    options = obj.get("stream_options")
    usage = type(options) is dict and options.get("include_usage") is True
    return usage or _budgeted(obj)


class Resumer:
    """Decides, for one streamed exchange, whether each break is continued (at most `limit` times)."""

    __slots__ = ("_api", "_body", "_booked", "_budgeted", "_counts", "_fields", "_max_size", "_model", "_next",
                 "_reason", "_running", "_stream", "estimated", "limit", "refusal", "resumes", "transcript")

    def __init__(
        self, api: str, body: bytes | bytearray, limit: int, max_size: int | None = None, *, request: object = _PARSE
    ) -> None:
        """`request` is the body's JSON object where the caller parsed it already (None: it was not
        parsed), so that a request is parsed once; else the body is parsed here."""
        self._api = api
        self._max_size = max_size  # --max-body-size: no continuation is sent past it
        self._stream: ChatStream | None = None  # the stream that records into the transcript
        self._next: bytes | None = None  # the continuation's body, built when one is due
        self.limit = limit
        self.transcript = Transcript(max_size)
        self.resumes = 0  # continuations that answered with a stream
        self._booked: list[tuple[Reason, ResumeResult]] = []  # (reason, result), in order
        self._running: Reason | None = None  # the break the streaming continuation mends (booked at its end)
        self.refusal: str | None = None  # why the last break was not continued
        self._reason: Reason | None = None  # the break being mended
        # The client's bytes (held for the send anyway, not copied), parsed again only when a
        # continuation is due: a body of many small objects is ~20 times its size as Python objects.
        self._body = body
        self._fields: dict[str, Any] | None = None  # the few fields a break's refusal rules read
        self._counts = False  # the tokens so far are worth counting, not guessing (see `count_request`)
        self._budgeted = False  # and without a count there is no continuation (a budget it could pass)
        # A continuation went out on a count of the answer so far that is only a lower bound: the usage
        # the client and the books get is an estimate.
        self.estimated = False
        self._model: object = None
        try:
            obj = parse_request(api, body) if request is _PARSE else checked_request(api, request)
            self._fields, self._counts, self._model = _rule_fields(obj), _counts_matter(obj), obj.get("model")
            self._budgeted = _budgeted(obj)
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
        """Keep the transcript from the chunks this stream's dialect parses (until it passes
        --max-body-size: then the stream goes back to its quick paths, recording nothing)."""
        if isinstance(stream, ChatStream):
            self._stream = stream
            stream.recorder = self._note

    def _note(self, obj: dict[str, Any]) -> None:
        transcript = self.transcript
        transcript.note(obj)
        if transcript.overflowed and self._stream is not None:
            self._stream.recorder = None
            self._stream = None

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
        """`/tokenize`'s answer: True when the continuation may go (built on the count, or on the chunks'
        lower bound where no budget needs it), else the break is refused: without a count the
        continuation could ask for more than the budget left."""
        assert self._reason is not None
        text = self.transcript.text
        try:
            count = read_count(status, answer, text)
        except Refusal as exc:
            return self.uncounted(str(exc))
        self.transcript.tokenized = (len(text), count)
        try:
            self._build()
        except Refusal as exc:
            self._refuse(self._reason, str(exc))
            self._reason = None
            return False
        return True

    def uncounted(self, why: str) -> bool:
        """The tokens so far could not be counted (no `/tokenize`, no count in its answer, none in time):
        False, the break refused, where the client set a budget; else True, the continuation goes as
        built, which asks no budget either (only the usage, then estimated, needed the count)."""
        assert self._reason is not None
        if not self._budgeted:
            return True
        self._refuse(self._reason, why)
        self._reason = None
        return False

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
        if not self.transcript.counted:  # (the stitcher moves a lower bound of tokens into the usage)
            self.estimated = True
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
