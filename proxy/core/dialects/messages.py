"""Anthropic Messages streams: named events ended by `message_stop`.

The Anthropic SDKs skip every frame without an `event:` line, so an error the upstream sent without
one (or in llama.cpp's flat shape) is invisible to them and must be rewritten; every frame the proxy
writes here carries `event:`. A `message_delta` with a `stop_reason` means the generation finished,
so a missing `message_stop` after it is added rather than reported as a cut.
"""

from __future__ import annotations

from typing import Any

from proxy.core.compile_attrs import mypyc_attr
from proxy.core.dialects.base import DialectStream, Kind, Usage, usage_from
from proxy.core.dialects.errors import ErrorCode, anthropic_error_body, describe_error, is_error_object
from proxy.core.dialects.repeat import ContentTemplate
from proxy.core.sse import Event

__all__ = ["MESSAGE_STOP_FRAME", "MessagesStream"]

MESSAGE_STOP_FRAME = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
# The string leaf of each delta type: what varies from one `content_block_delta` to the next.
_DELTA_TEXT = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}


@mypyc_attr(allow_interpreted_subclasses=True)  # (compiled: subclassed by the tests)
class MessagesStream(DialectStream):
    """Tracks the stop reason and the usage split over `message_start` and `message_delta`."""

    __slots__ = ("_prompt", "_stopped", "_template")

    def __init__(self) -> None:
        super().__init__()
        self._stopped = False
        self._prompt: int | None = None
        self._template = ContentTemplate()

    def may_repeat(self) -> bool:
        return self._template.hopeful

    def repeats(self, chunk: bytes, start: int, limit: int) -> tuple[int, int]:
        """A `content_block_delta` changes no state: a repeat of one is CONTENT and nothing else."""
        return self._template.run(chunk, start, limit)

    @property
    def finished(self) -> bool:
        return self._stopped

    def classify_object(self, event: Event, obj: dict[str, Any]) -> Kind:
        name = event.event
        kind = obj.get("type")
        if kind == "error" or name == "error":
            self.error = describe_error(obj)
            err = obj.get("error")
            native = name == "error" and kind == "error"
            if native and isinstance(err, dict) and isinstance(err.get("message"), str):
                return Kind.ERROR
            return Kind.FOREIGN
        if name is None:
            # The SDKs ignore a frame without `event:`: harmless unless it is an error they would miss.
            if obj.get("error") or is_error_object(obj):
                self.error = describe_error(obj)
                return Kind.FOREIGN
            return Kind.PASS
        if kind == "content_block_delta":
            self._learn(event, name, obj)
            return Kind.CONTENT
        if kind == "message_stop":
            return Kind.TERMINAL
        if kind == "message_start":
            message = obj.get("message")
            if isinstance(message, dict):
                self._add_usage(message.get("usage"), with_output=False)
                model = message.get("model")
                if isinstance(model, str) and model:
                    self.response_model = model
        elif kind == "message_delta":
            delta = obj.get("delta")
            if isinstance(delta, dict) and delta.get("stop_reason"):
                self._stopped = True
                reason = delta["stop_reason"]
                if isinstance(reason, str):
                    self.finish_reasons = (reason,)
            self._add_usage(obj.get("usage"), with_output=True)
        return Kind.PASS

    def _learn(self, event: Event, name: str, obj: dict[str, Any]) -> None:
        """A delta's text (or thinking, or partial JSON) as the template's leaf."""
        delta = obj.get("delta")
        if type(delta) is not dict:
            return
        key = _DELTA_TEXT.get(delta.get("type"))  # type: ignore[arg-type]
        if key is None:
            return
        text = delta.get(key)
        if type(text) is str and text:
            prefix = b"event: " + name.encode() + b"\ndata: "
            self._template.learn(event.data, obj, delta, key, prefix=prefix, raw=event.raw)

    def _add_usage(self, usage: object, *, with_output: bool) -> None:
        """Input from `message_start` (or a later delta that repeats it); output from `message_delta`.

        `message_start` carries a placeholder `output_tokens` (1 or so) before anything was generated;
        taking it would book an abandoned stream as one token. Output counts only from a delta, where
        it is cumulative.
        """
        found = usage_from(usage, "input_tokens", "output_tokens")
        if found is None:
            return
        if found.prompt_tokens is not None:
            self._prompt = found.prompt_tokens
        completion = found.completion_tokens if with_output else None
        if completion is None and self.usage is not None:
            completion = self.usage.completion_tokens
        self.usage = Usage(self._prompt, completion)

    def error_frame(self, status: int, message: str, code: ErrorCode | None = None) -> bytes:
        return b"event: error\ndata: " + anthropic_error_body(status, message) + b"\n\n"

    def terminal_frame(self) -> bytes | None:
        return MESSAGE_STOP_FRAME
