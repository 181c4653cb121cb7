"""The one small interface every dialect implements, and the per-event verdicts it returns.

A `Dialect` is stateless and shared; a `DialectStream` holds what one streamed exchange needs to
remember (finish reasons, usage, the response id) so that the guard can decide, event by event,
whether to forward, hold, drop or end the stream. Nothing here does I/O.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.core.compile_attrs import mypyc_attr
from proxy.core.dialects.errors import ErrorCode, ErrorInfo, anthropic_error_body, describe_error, openai_error_body
from proxy.core.sse import Event

__all__ = ["Dialect", "DialectStream", "Kind", "Usage", "described_usage", "reported", "usage_from"]


class Kind(enum.Enum):
    """What one upstream event means to the guard."""

    COMMENT = enum.auto()  # comment-only block: forward (or hold), not counted as an event
    PASS = enum.auto()  # an event without generated content (prelude, usage, finish chunk): forward or hold
    CONTENT = enum.auto()  # carries generated content: commits a held response
    TERMINAL = enum.auto()  # the dialect's normal terminal frame: forward it, the stream is complete
    END = enum.auto()  # a `[DONE]` in a dialect that has another terminal: drop it, treat it as the end
    ERROR = enum.auto()  # an error in the dialect's own shape: forward, add `error_tail()`, end
    FOREIGN = enum.auto()  # an error in another shape: replace it with the dialect's error frame, end
    MALFORMED = enum.auto()  # the SDKs would die on it: drop this one event, stream on
    EARLY_DONE = enum.auto()  # `[DONE]` while a choice that produced output has no finish_reason
    ABORTED = enum.auto()  # the backend aborted the generation (vLLM's `finish_reason: "abort"`): a failure


@dataclass(slots=True, init=False)
class Usage:
    """What the upstream reported about the generation: token counts (either may be missing) and, for
    traces, the model that answered and why each choice stopped (not part of equality: the books
    compare counts)."""

    # (Not frozen, like the other records made on every request: a frozen dataclass takes three times the
    # work to make, an object.__setattr__ per field; nothing assigns to one once made.)

    prompt_tokens: int | None
    completion_tokens: int | None
    model: str | None = field(default=None, compare=False)
    finish_reasons: tuple[str, ...] = field(default=(), compare=False)

    # (`__init__` written out, not the dataclass's: compiled, the dataclass's generated one is an
    # interpreted call with an argument tuple, three times the work of a native one.)
    def __init__(self, prompt_tokens: int | None, completion_tokens: int | None, model: str | None = None,
                 finish_reasons: tuple[str, ...] = ()) -> None:  # fmt: skip
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.model = model
        self.finish_reasons = finish_reasons

    def described(self, model: str | None, finish_reasons: tuple[str, ...]) -> Usage:
        return Usage(self.prompt_tokens, self.completion_tokens, model, finish_reasons)


def reported(usage: Usage | None, model: str | None, finish_reasons: tuple[str, ...]) -> Usage | None:
    """`usage` with the model and finish reasons added; a count-less Usage when only those are known."""
    if model is None and not finish_reasons:
        return usage
    return (usage or Usage(None, None)).described(model, finish_reasons)


def _count(value: object) -> int | None:
    return value if type(value) is int and value >= 0 else None


def described_usage(
    obj: object, keys: tuple[str, str] | None, model: str | None, finish_reasons: tuple[str, ...]
) -> Usage | None:
    """`reported(usage_from(obj, *keys), model, finish_reasons)` (no counts read without `keys`),
    made at once: one `Usage` at most."""
    prompt = completion = None
    if keys is not None and isinstance(obj, dict):  # (`_count` of each, inlined)
        prompt, completion = obj.get(keys[0]), obj.get(keys[1])
        if type(prompt) is not int or prompt < 0:
            prompt = None
        if type(completion) is not int or completion < 0:
            completion = None
    if prompt is None and completion is None and model is None and not finish_reasons:
        return None
    return Usage(prompt, completion, model, finish_reasons)


def usage_from(obj: object, prompt_key: str, completion_key: str) -> Usage | None:
    """Read a `usage` object; None when it carries neither count."""
    if not isinstance(obj, dict):
        return None
    prompt, completion = _count(obj.get(prompt_key)), _count(obj.get(completion_key))
    if prompt is None and completion is None:
        return None
    return Usage(prompt, completion)


@mypyc_attr(allow_interpreted_subclasses=True)  # (compiled: so that its dialects allow theirs)
class DialectStream(ABC):
    """Per-exchange streaming state: classifies events and builds the frames the proxy writes.

    After `classify` returned `Kind.ERROR`, `Kind.FOREIGN` or `Kind.ABORTED`, `error` describes the
    upstream's error.
    """

    __slots__ = ("error", "finish_reasons", "response_model", "usage")

    json_events = True  # events must carry JSON data (the SDKs parse every one)

    def __init__(self) -> None:
        self.error: ErrorInfo | None = None
        self.usage: Usage | None = None
        self.response_model: str | None = None  # the first `model` the upstream named
        self.finish_reasons: tuple[str, ...] = ()  # in choice order, as far as the stream got

    def report(self) -> Usage | None:
        """The usage, with the model and finish reasons (read once, when the stream is over)."""
        return reported(self.usage, self.response_model, self.finish_reasons)

    @property
    @abstractmethod
    def finished(self) -> bool:
        """The generation visibly finished, so a clean EOF is a success (with `terminal_frame()`)."""

    def classify(self, event: Event) -> Kind:
        """Read one event (at most one JSON parse) and update the stream's state.

        The JSON dialects share this prologue; each reads its own objects in `classify_object`.
        """
        data = event.data
        if not data:
            return self.classify_fieldless(event)
        if data.startswith(b"[DONE]"):
            return self.classify_done()
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return Kind.MALFORMED
        if type(obj) is not dict:
            return Kind.MALFORMED
        return self.classify_object(event, obj)

    def may_repeat(self) -> bool:
        """Whether `repeats` may ever find one (else the guard reads every chunk in one piece)."""
        return False

    def repeats(self, chunk: bytes, start: int, limit: int) -> tuple[int, int]:
        """How many whole one-line `data:` events (each at most `limit` bytes) from `start` on are ones
        `classify` would call CONTENT while changing nothing in this stream's state, and the offset
        after the last: a quick check that parses nothing, (0, start) when unsure."""
        return 0, start

    def classify_done(self) -> Kind:
        """A `[DONE]`: in dialects whose terminal is another event, the upstream's end of stream."""
        return Kind.END

    def classify_object(self, event: Event, obj: dict[str, Any]) -> Kind:
        """One event whose data is a JSON object."""
        raise NotImplementedError

    @abstractmethod
    def error_frame(self, status: int, message: str, code: ErrorCode | None = None) -> bytes:
        """The complete bytes that end this stream with an error the dialect's SDKs raise."""

    def error_tail(self) -> bytes:
        """What to add after an upstream error in the dialect's own shape (which was forwarded)."""
        return b""

    def terminal_frame(self) -> bytes | None:
        """What to append when the generation finished but the upstream sent no terminal frame."""
        return None

    def classify_fieldless(self, event: Event) -> Kind:
        """An event with an empty data buffer: a comment, a bare `error:` line, or unparseable."""
        if event.event is None and event.id is None and event.retry is None and not event.has_data:
            if b"error" in event.raw:
                info = bare_error(event.raw)
                if info is not None:
                    self.error = info
                    return Kind.FOREIGN
            return Kind.COMMENT
        return Kind.MALFORMED if self.json_events else Kind.PASS


def bare_error(raw: bytes) -> ErrorInfo | None:
    """The value of a non-standard `error:` field (old llama.cpp), which every SSE parser ignores."""
    for line in raw.splitlines():
        if line.startswith(b"error:") or line == b"error":
            value = line[6:]
            if value.startswith(b" "):
                value = value[1:]
            try:
                obj = orjson.loads(value)
            except orjson.JSONDecodeError:
                obj = None
            if isinstance(obj, dict):
                return describe_error(obj)
            text = value.decode("utf-8", "replace").strip()
            return ErrorInfo(502, text or "upstream sent an error", None)
    return None


@dataclass(frozen=True, slots=True)
class Dialect:
    """One API dialect: its metric label, its error shape and a factory for its stream state."""

    name: str
    json_body: bool
    anthropic: bool
    stream_factory: Callable[[], DialectStream]

    def error_body(self, status: int, message: str, code: ErrorCode | None = None) -> bytes:
        """A whole-body JSON error in the dialect's shape, typed from the status."""
        if self.anthropic:
            return anthropic_error_body(status, message)
        return openai_error_body(status, message, code)

    def new_stream(self) -> DialectStream:
        return self.stream_factory()

    def own_error_shape(self, obj: object) -> bool:
        """The body is an error the dialect's SDKs read as is (so it passes untouched)."""
        if not isinstance(obj, dict):
            return False
        err = obj.get("error")
        if not isinstance(err, dict) or not isinstance(err.get("message"), str):
            return False
        if self.anthropic:
            return obj.get("type") == "error" and isinstance(err.get("type"), str)
        return True
