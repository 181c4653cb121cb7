"""Streams of paths the proxy does not know (TGI `/generate_stream`, custom endpoints): passed through.

Nothing is known about their framing, so every event is forwarded and a clean EOF counts as
complete. Only what is an error in any SSE dialect is acted on: `event: error`, a data object with a
truthy `error`, and the non-standard bare `error:` field that every parser silently ignores.
"""

from __future__ import annotations

import orjson

from proxy.core.dialects.base import DialectStream, Kind
from proxy.core.dialects.errors import ErrorCode, ErrorInfo, cut, describe_error, dumps, openai_error
from proxy.core.sse import Event

__all__ = ["OtherStream"]


class OtherStream(DialectStream):
    __slots__ = ()

    json_events = False

    @property
    def finished(self) -> bool:
        return True  # the proxy cannot tell a finished generation here, so it never calls EOF a cut

    def classify(self, event: Event) -> Kind:
        data = event.data
        if not data:
            return self.classify_fieldless(event)
        if data.startswith(b"[DONE]"):
            return Kind.TERMINAL
        if event.event == "error" or b'"error"' in data:
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                obj = None
            if isinstance(obj, dict) and (event.event == "error" or obj.get("error")):
                self.error = describe_error(obj)
                return Kind.ERROR
            if event.event == "error":
                text = data.decode("utf-8", "replace").strip()
                self.error = ErrorInfo(502, cut(text) or "upstream sent an error", None)
                return Kind.ERROR
        return Kind.CONTENT

    def error_frame(self, status: int, message: str, code: ErrorCode | None = None) -> bytes:
        return b"event: error\ndata: " + dumps({"error": openai_error(status, message, code)}) + b"\n\n"
