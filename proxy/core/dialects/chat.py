"""OpenAI data-only streams: Chat Completions and legacy Completions (and the never-streamed rest).

The wire format is `data: <json>` events ended by `data: [DONE]`. Backends end badly in four ways
this module notices: an EOF without `[DONE]` (only a truncation when some choice has no
finish_reason yet), a `[DONE]` after a choice was cut short, a choice vLLM ended with
`finish_reason: "abort"`, and errors in a dozen shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from proxy.core.compile_attrs import mypyc_attr
from proxy.core.dialects.base import DialectStream, Kind, usage_from
from proxy.core.dialects.errors import ErrorCode, ErrorInfo, describe_error, dumps, is_error_object, openai_error
from proxy.core.dialects.repeat import ContentTemplate
from proxy.core.sse import Event

__all__ = ["ABORTED", "ABORT_REASON", "DONE_FRAME", "ChatStream"]

DONE_FRAME = b"data: [DONE]\n\n"
# vLLM ends a choice with this non-OpenAI finish_reason when its engine aborts the request (shutdown,
# an abort call, a sleep or scale-down pause), then sends `[DONE]`: a cut answer dressed as complete.
ABORT_REASON = "abort"
ABORTED = ErrorInfo(502, 'the upstream aborted the generation (finish_reason "abort")', "upstream_aborted")
# What a choice (by index) did so far, one bit each: a seen choice is in the stream's dict (one dict
# rather than three sets: a held stream's state is a few hundred bytes smaller).
_FINISHED, _PRODUCED = 1, 2


@mypyc_attr(allow_interpreted_subclasses=True)  # (compiled: subclassed by the tests)
class ChatStream(DialectStream):
    """Tracks, per choice index, whether it produced output and whether it has a finish_reason."""

    __slots__ = ("_choices", "_reasons", "_template", "recorder")

    def __init__(self) -> None:
        super().__init__()
        # --resume-on-cut: told every chunk, to keep the answer so far (proxy/core/resume/transcript.py)
        self.recorder: Callable[[dict[str, Any]], None] | None = None
        self._template = ContentTemplate()
        self._choices: dict[int, int] = {}  # index -> _FINISHED | _PRODUCED
        self._reasons: dict[int, str] = {}

    @property
    def finished(self) -> bool:
        choices = self._choices
        return bool(choices) and all(flags & _FINISHED for flags in choices.values())

    def may_repeat(self) -> bool:
        return self.recorder is None and self._template.hopeful

    def repeats(self, chunk: bytes, start: int, limit: int) -> tuple[int, int]:
        if self.recorder is not None:  # (it must see every chunk)
            return 0, start
        return self._template.run(chunk, start, limit)

    def classify_done(self) -> Kind:
        cut = any(flags & (_FINISHED | _PRODUCED) == _PRODUCED for flags in self._choices.values())
        return Kind.EARLY_DONE if cut else Kind.TERMINAL

    def classify_object(self, event: Event, obj: dict[str, Any]) -> Kind:
        err = obj.get("error")
        if err:
            self.error = describe_error(obj)
            # A dict under `error` is what makes the SDKs raise; anything else must be rewritten.
            return Kind.ERROR if isinstance(err, dict) else Kind.FOREIGN
        choices = obj.get("choices")
        if type(choices) is not list:
            if event.event == "error" or is_error_object(obj):
                self.error = describe_error(obj)
                return Kind.FOREIGN
            return Kind.PASS
        usage = obj.get("usage")
        if usage:
            self.usage = usage_from(usage, "prompt_tokens", "completion_tokens") or self.usage
        if self.response_model is None:
            model = obj.get("model")
            if type(model) is str and model:
                self.response_model = model
        if self.recorder is not None:
            self.recorder(obj)
        content = False
        for choice in choices:
            if type(choice) is not dict:
                continue
            index = choice.get("index", 0)
            if type(index) is not int:
                index = 0
            flags = self._choices.setdefault(index, 0)
            reason = choice.get("finish_reason")
            if reason:
                if type(reason) is str:
                    self._reasons[index] = reason
                    self.finish_reasons = tuple(self._reasons[i] for i in sorted(self._reasons))
                if reason == ABORT_REASON:
                    self.error = ABORTED
                    return Kind.ABORTED
                flags |= _FINISHED
            delta = choice.get("delta")
            if type(delta) is dict:
                # Text is the common case; tool calls, reasoning, refusals and audio count as output too.
                produced = bool(delta.get("content")) or any(v for k, v in delta.items() if k != "role")
            else:
                produced = bool(choice.get("text"))
            if produced:
                flags |= _PRODUCED
                content = True
            self._choices[index] = flags
        if content and not usage and len(choices) == 1 and self.recorder is None and self._template.hopeful:
            self._learn(event.data, obj, choices[0])  # (a template only serves `repeats`: not with a recorder)
        return Kind.CONTENT if content else Kind.PASS

    def _learn(self, data: bytes, obj: dict[str, Any], choice: Any) -> None:
        """A lone choice's text as the template's leaf: with no usage and no finish_reason, a repeat
        adds only the choice index this event already noted (`repeats` is then exact)."""
        if choice.get("finish_reason"):
            return
        delta = choice.get("delta")
        holder, key = (delta, "content") if type(delta) is dict else (choice, "text")
        text = holder.get(key)
        if type(text) is str and text:
            self._template.learn(data, obj, holder, key)

    def error_frame(self, status: int, message: str, code: ErrorCode | None = None) -> bytes:
        error = dumps({"error": openai_error(status, message, code)})
        return b"data: " + error + b"\n\n" + DONE_FRAME

    def error_tail(self) -> bytes:
        return DONE_FRAME

    def terminal_frame(self) -> bytes | None:
        return DONE_FRAME
