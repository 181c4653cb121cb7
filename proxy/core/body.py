"""Verdicts on whole (non-stream) response bodies (docs/failures.md).

A 200 is not always a success: vLLM has answered `null` and ends choices its engine aborted with
`finish_reason: "abort"`, backends hide error objects in 2xx bodies, and batched completions have
come back with choices missing. Error bodies come in every backend's
shape and as load balancers' HTML pages; the client's SDK only reads its own. This module decides,
without I/O, whether the upstream body passes as is or is replaced by one in the dialect's shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from proxy.core.dialects import Dialect, RequestInfo, Usage
from proxy.core.dialects.base import described_usage, usage_from
from proxy.core.dialects.chat import ABORT_REASON, ABORTED
from proxy.core.dialects.errors import ErrorCode, cut, describe_error, error_message, is_error_object, text_message
from proxy.core.lifecycle import Outcome, Reason, reason_for_status, status_for

__all__ = ["TAIL_BYTES", "BodyVerdict", "judge_body", "usage_from_tail"]

_USAGE_KEYS: dict[str, tuple[str, str]] = {
    "chat_completions": ("prompt_tokens", "completion_tokens"),
    "completions": ("prompt_tokens", "completion_tokens"),
    "embeddings": ("prompt_tokens", "completion_tokens"),
    "responses": ("input_tokens", "output_tokens"),
    "messages": ("input_tokens", "output_tokens"),
}
_NOT_JSON = object()
TAIL_BYTES = 64 * 1024  # the end of a body too large to judge whole: where its `usage` object is
_CHOICE_DIALECTS = frozenset({"chat_completions", "completions"})


@dataclass(slots=True, init=False)
class BodyVerdict:
    # (Not frozen, like the other records made on every request: a frozen dataclass takes three times the
    # work to make, an object.__setattr__ per field; nothing assigns to one once made.)
    outcome: Outcome
    reason: Reason
    replacement: tuple[int, bytes] | None  # (status, dialect error JSON) instead of the upstream's body
    usage: Usage | None
    upstream_message: str | None = None  # the upstream's own error message, for the log line

    # (`__init__` written out, not the dataclass's: compiled, the dataclass's generated one is an
    # interpreted call with an argument tuple, three times the work of a native one.)
    def __init__(self, outcome: Outcome, reason: Reason, replacement: tuple[int, bytes] | None, usage: Usage | None,
                 upstream_message: str | None = None) -> None:  # fmt: skip
        self.outcome = outcome
        self.reason = reason
        self.replacement = replacement
        self.usage = usage
        self.upstream_message = upstream_message


def _parse(content_type: str | None, body: bytes) -> object:
    if content_type is not None and "html" in content_type.lower():
        return _NOT_JSON
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return _NOT_JSON


def judge_body(
    dialect: Dialect, request: RequestInfo, status: int, content_type: str | None, body: bytes
) -> BodyVerdict:
    """Pass the upstream's response, or replace it with the dialect's error JSON, and say why."""
    if status < 400:
        if dialect.json_body and 200 <= status < 300 and status not in (204, 205):  # those have no body
            return _judge_success(dialect, request, content_type, body)
        return BodyVerdict(Outcome.OK, Reason.COMPLETE, None, None)
    reason = reason_for_status(status)
    if not dialect.json_body:
        return BodyVerdict(Outcome.ERROR, reason, None, None)
    replacement, message = _reshape_error(dialect, status, content_type, body, reason)
    return BodyVerdict(Outcome.ERROR, reason, replacement, None, message)


def _judge_success(dialect: Dialect, request: RequestInfo, content_type: str | None, body: bytes) -> BodyVerdict:
    obj = _parse(content_type, body)
    if obj is _NOT_JSON or not isinstance(obj, dict):
        if not body.strip():
            problem = "an empty body"
        elif obj is None:
            problem = "a null body"
        else:
            problem = "a body that is not a JSON object"
        reason = Reason.INVALID_UPSTREAM_BODY
        return _replace(dialect, status_for(reason), f"the upstream answered with {problem}", reason)
    if is_error_object(obj):
        info = describe_error(obj)
        verdict = _replace(dialect, info.status, info.message, Reason.UPSTREAM_ERROR_FRAME, info.code)
        return BodyVerdict(verdict.outcome, verdict.reason, verdict.replacement, None, info.message)
    name = dialect.name
    model, reasons, of_choices = _described(obj)
    usage = described_usage(obj.get("usage"), _USAGE_KEYS.get(name), model, reasons)
    if of_choices and ABORT_REASON in reasons and name in _CHOICE_DIALECTS:
        # A choice vLLM ended with `finish_reason: "abort"` (the engine dropped the request midway):
        # failed, but the tokens were generated, so their usage is still booked.
        body = dialect.error_body(ABORTED.status, ABORTED.message, ABORTED.code)
        return BodyVerdict(Outcome.ERROR, Reason.UPSTREAM_ABORTED, (ABORTED.status, body), usage)
    if name == "completions":
        missing = _missing_choices(obj, request.prompts * request.n)
        if missing:
            return _replace(dialect, status_for(Reason.INCOMPLETE_BATCH), missing, Reason.INCOMPLETE_BATCH)
    return BodyVerdict(Outcome.OK, Reason.COMPLETE, None, usage)


def _described(obj: dict[str, Any]) -> tuple[str | None, tuple[str, ...], bool]:
    """The answering model and the finish reasons of a whole body, in any dialect's shape (for traces
    and the abort check), and whether those came from its `choices` (chat, completions)."""
    model = obj.get("model")
    if not isinstance(model, str) or not model:
        model = None
    choices = obj.get("choices")
    if isinstance(choices, list):  # chat and completions: one pass over the choices
        found: list[str] = []
        for choice in choices:
            if isinstance(choice, dict):
                reason = choice.get("finish_reason")
                if isinstance(reason, str):
                    found.append(reason)
        return model, tuple(found), True
    reasons: tuple[str, ...] = ()
    if isinstance(obj.get("stop_reason"), str):  # messages
        reasons = (obj["stop_reason"],)
    elif isinstance(obj.get("status"), str) and obj.get("object") == "response":  # responses
        details = obj.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        reasons = (reason if isinstance(reason, str) and reason else obj["status"],)
    return model, reasons, False


def _missing_choices(obj: dict[str, object], expected: int) -> str | None:
    """A message naming the choice indices 0..expected-1 that the body lacks, if any."""
    choices = obj.get("choices")
    found: set[int] = set()
    if isinstance(choices, list):
        for choice in choices:
            index = choice.get("index") if isinstance(choice, dict) else None
            if type(index) is int:
                found.add(index)
    missing = [index for index in range(expected) if index not in found]
    if not missing:
        return None
    count = len(choices) if isinstance(choices, list) else 0
    names = ", ".join(map(str, missing[:50])) + (", ..." if len(missing) > 50 else "")
    return cut(f"the upstream returned {count} of {expected} choices; missing indices: {names}")


def _replace(dialect: Dialect, status: int, message: str, reason: Reason, code: ErrorCode | None = None) -> BodyVerdict:
    return BodyVerdict(Outcome.ERROR, reason, (status, dialect.error_body(status, message, code or reason)), None)


def _reshape_error(
    dialect: Dialect, status: int, content_type: str | None, body: bytes, reason: Reason
) -> tuple[tuple[int, bytes] | None, str | None]:
    """(None when the error is already in the dialect's shape, else the same status reshaped; the
    upstream's own message, when it gave one)."""
    obj = _parse(content_type, body)
    code: ErrorCode | None = None
    if isinstance(obj, dict):
        message = error_message(obj)
        if dialect.own_error_shape(obj):
            return None, message
        code = describe_error(obj).code
    elif isinstance(obj, str):
        message = cut(obj.strip()) or None
    else:
        message = text_message(body)
    reshaped = message or f"the upstream answered with HTTP {status}"
    return (status, dialect.error_body(status, reshaped, code or reason)), message


def usage_from_tail(dialect: Dialect, tail: bytes) -> Usage | None:
    """The `usage` object near the end of a 2xx body that was relayed without being read whole.

    OpenAI-style bodies end with it (`..., "usage": {...}}`); it is found by its key and read as the
    balanced object that follows. None when the tail holds no such object.
    """
    keys = _USAGE_KEYS.get(dialect.name)
    at = tail.rfind(b'"usage"')
    if keys is None or at < 0:
        return None
    start = tail.find(b"{", at)
    if start < 0 or tail[at + 7 : start].strip(b" \t\r\n:"):
        return None
    depth = 0
    for index in range(start, len(tail)):
        byte = tail[index]
        if byte == 0x7B:  # {
            depth += 1
        elif byte == 0x7D:  # }
            depth -= 1
            if depth == 0:
                try:
                    return usage_from(orjson.loads(tail[start : index + 1]), *keys)
                except orjson.JSONDecodeError:
                    return None
    return None
