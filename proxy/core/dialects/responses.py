"""OpenAI Responses API streams: named events with increasing `sequence_number`s.

There is no `[DONE]`; only `response.completed`, `response.incomplete` or `response.failed` ends a
stream, so an EOF without one is always a truncation. An error ending is the pair `response.failed`
(which consumers keyed on the response see) then `error` (nested, which makes openai-python raise),
and every frame the proxy adds continues the upstream's response id and sequence numbers.
"""

from __future__ import annotations

from typing import Any

from proxy.core.compile_attrs import mypyc_attr
from proxy.core.dialects.base import DialectStream, Kind, usage_from
from proxy.core.dialects.errors import (
    ErrorCode,
    ErrorInfo,
    cut,
    describe_error,
    dumps,
    is_error_object,
    openai_type,
    responses_code,
)
from proxy.core.dialects.repeat import ContentTemplate
from proxy.core.sse import Event

__all__ = ["ResponsesStream"]

_PRELUDE = frozenset({"response.created", "response.in_progress", "response.queued"})
_TERMINAL = frozenset({"response.completed", "response.incomplete"})
_CODE_STATUS = {"rate_limit_exceeded": 429, "invalid_prompt": 400, "server_error": 500}


@mypyc_attr(allow_interpreted_subclasses=True)  # (compiled: subclassed by the tests)
class ResponsesStream(DialectStream):
    """Remembers the response object's identity and the last sequence number, to continue both."""

    __slots__ = ("_response", "_seq", "_template")

    def __init__(self) -> None:
        super().__init__()
        self._seq = -1
        self._response: dict[str, object] = {}
        self._template = ContentTemplate()  # `*.delta` events: the delta and the sequence number vary

    def may_repeat(self) -> bool:
        return self._template.hopeful

    def repeats(self, chunk: bytes, start: int, limit: int) -> tuple[int, int]:
        """A repeat of a delta event is CONTENT whose only effect is its sequence number (the largest
        one is what the proxy's own frames continue from; taking it early is the same, see guard)."""
        template = self._template
        count, end = template.run(chunk, start, limit)
        if count and template.number > self._seq:
            self._seq = template.number
        return count, end

    @property
    def finished(self) -> bool:
        return False  # only a terminal event finishes a response, and it ends the stream itself

    def classify_object(self, event: Event, obj: dict[str, Any]) -> Kind:
        kind = self._classify(event, obj)
        seq = obj.get("sequence_number")
        if kind is not Kind.FOREIGN and type(seq) is int and seq > self._seq:
            self._seq = seq  # (a foreign event is rebuilt, not passed: the rebuilt one takes the next number)
        return kind

    def _classify(self, event: Event, obj: dict[str, Any]) -> Kind:
        kind = obj.get("type") or event.event
        if isinstance(kind, str) and kind.startswith("response."):
            if kind.endswith(".delta"):
                delta = obj.get("delta")
                if not delta:
                    return Kind.PASS
                if type(delta) is str and obj.get("type") == kind:
                    self._learn(event, obj)
                return Kind.CONTENT
            response = obj.get("response")
            if kind in _PRELUDE:
                self._remember(response)
            elif kind in _TERMINAL:
                self._take_usage(response)
                self._take_status(response)
                return Kind.TERMINAL
            elif kind == "response.failed":
                self._remember(response)
                self._take_usage(response)
                self.error = self._failed_info(response)
                return Kind.ERROR
            return Kind.PASS
        if kind == "error":
            # Rebuilt, never passed: the ending must be `response.failed` then `error` with both the
            # top-level and the nested fields (only the nested one makes openai-python raise, and
            # consumers keyed on `response.failed` must see it first), whichever shape came.
            self.error = describe_error(obj)
            return Kind.FOREIGN
        if obj.get("error") or is_error_object(obj):
            self.error = describe_error(obj)
            return Kind.FOREIGN
        return Kind.PASS

    def _learn(self, event: Event, obj: dict[str, Any]) -> None:
        """The delta as the text leaf and the sequence number, when it is an int, as the integer one:
        a repeat is a `*.delta` event of the same type whose effect is `_seq = max(_seq, its number)`."""
        name = event.event
        if name is None:
            return
        seq = obj.get("sequence_number")
        number = (obj, "sequence_number") if type(seq) is int else None
        if number is None and "sequence_number" in obj:
            return  # (a sequence number of another type: never a repeat)
        prefix = b"event: " + name.encode() + b"\ndata: "
        self._template.learn(event.data, obj, obj, "delta", number=number, prefix=prefix, raw=event.raw)

    def _remember(self, response: object) -> None:
        if isinstance(response, dict):
            for key in ("id", "created_at", "model"):
                if key in response:
                    self._response[key] = response[key]
            model = response.get("model")
            if isinstance(model, str) and model:
                self.response_model = model

    def _take_status(self, response: object) -> None:
        """The terminal status (`completed`, `incomplete`), or why it is incomplete (`max_output_tokens`)."""
        if not isinstance(response, dict):
            return
        model = response.get("model")
        if self.response_model is None and isinstance(model, str) and model:
            self.response_model = model
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        status = reason if isinstance(reason, str) and reason else response.get("status")
        if isinstance(status, str) and status:
            self.finish_reasons = (status,)

    def _take_usage(self, response: object) -> None:
        if isinstance(response, dict):
            self.usage = usage_from(response.get("usage"), "input_tokens", "output_tokens") or self.usage

    @staticmethod
    def _failed_info(response: object) -> ErrorInfo:
        error = response.get("error") if isinstance(response, dict) else None
        if not isinstance(error, dict):
            return ErrorInfo(502, "upstream response failed", None)
        code = error.get("code")
        message = error.get("message")
        return ErrorInfo(
            _CODE_STATUS.get(code, 502) if isinstance(code, str) else 502,
            cut(message) if isinstance(message, str) and message else "upstream response failed",
            code if isinstance(code, str) and code else None,
        )

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _failed_event(self, status: int, message: str) -> bytes:
        response = {
            "id": self._response.get("id", "resp_streamwarden"),
            "object": "response",
            "created_at": self._response.get("created_at", 0),
            "model": self._response.get("model", ""),
            "status": "failed",
            "error": {"code": responses_code(status), "message": cut(message)},
            "incomplete_details": None,
            "output": [],
            "usage": None,
        }
        body = {"type": "response.failed", "sequence_number": self._next_seq(), "response": response}
        return b"event: response.failed\ndata: " + dumps(body) + b"\n\n"

    def _error_event(self, status: int, message: str, code: ErrorCode | None) -> bytes:
        code = code or responses_code(status)
        message = cut(message)
        body = {
            "type": "error",
            "sequence_number": self._next_seq(),
            "code": code,
            "message": message,
            "param": None,
            "error": {"type": openai_type(status), "code": code, "message": message, "param": None},
        }
        return b"event: error\ndata: " + dumps(body) + b"\n\n"

    def error_frame(self, status: int, message: str, code: ErrorCode | None = None) -> bytes:
        return self._failed_event(status, message) + self._error_event(status, message, code)

    def error_tail(self) -> bytes:
        """After the upstream's own `response.failed`: the `error` event that makes the SDK raise."""
        info = self.error or ErrorInfo(502, "upstream error", None)
        return self._error_event(info.status, info.message, info.code)
