"""Error shapes: read an error in any backend's shape, write one in the dialect's own.

Backends disagree on how an error looks (vLLM nests it, SGLang and LMDeploy flatten it, TGI uses a
string, FastAPI says `detail`); clients only understand their own SDK's shape. This module is the one
place that knows both sides, including the status -> error type tables (docs/failures.md).
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass

import orjson

__all__ = [
    "MAX_MESSAGE",
    "ErrorCode",
    "ErrorInfo",
    "anthropic_error_body",
    "anthropic_type",
    "cut",
    "describe_error",
    "dumps",
    "error_message",
    "is_error_object",
    "openai_error",
    "openai_error_body",
    "openai_type",
    "responses_code",
    "text_message",
]

MAX_MESSAGE = 500
# An upstream's own error code, carried over as it gave it: a string (`context_length_exceeded`) or a
# number (vLLM, SGLang and llama.cpp put the HTTP status there). Clients branch on it.
ErrorCode = str | int

# Error type names whose status is unambiguous (the inverse of the tables below, plus Responses codes).
_TYPE_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "rate_limit_exceeded": 429,
    "overloaded_error": 529,
    "timeout_error": 504,
}
_STATUS_KEYS = ("code", "status", "status_code", "http_status_code")
# Keys that only a successful object carries: their presence means "not an error object".
_SUCCESS_KEYS = frozenset({"choices", "data", "output", "content", "embedding"})
_TITLE = re.compile(rb"<title[^>]*>(.*?)</title\s*>", re.IGNORECASE | re.DOTALL)
_TAG = re.compile(r"<[^>]*>")
_SPACE = re.compile(r"\s+")


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """An upstream error reduced to what the proxy needs to write it again in another shape."""

    status: int  # a valid 4xx/5xx, else 502
    message: str
    code: ErrorCode | None  # the upstream's own code, when it gave one


def openai_type(status: int) -> str:
    match status:
        case 401:
            return "authentication_error"
        case 403:
            return "permission_error"
        case 429:
            return "rate_limit_error"
        case 504:
            return "timeout_error"
        case _ if 400 <= status < 500:
            return "invalid_request_error"
        case _:
            return "server_error"


def anthropic_type(status: int) -> str:
    match status:
        case 400:
            return "invalid_request_error"
        case 401:
            return "authentication_error"
        case 403:
            return "permission_error"
        case 404:
            return "not_found_error"
        case 413:
            return "request_too_large"
        case 429:
            return "rate_limit_error"
        case 503 | 529:
            return "overloaded_error"
        case 504:
            return "timeout_error"
        case _ if 400 <= status < 500:
            return "invalid_request_error"
        case _:
            return "api_error"


def responses_code(status: int) -> str:
    """`response.failed.response.error.code`, which is an enum in the Responses API."""
    if status == 429:
        return "rate_limit_exceeded"
    if 400 <= status < 500:
        return "invalid_prompt"
    return "server_error"


def cut(message: str) -> str:
    """At most MAX_MESSAGE characters, and always encodable (no lone surrogates)."""
    message = message[:MAX_MESSAGE]
    if not message.isascii():
        message = message.encode("utf-8", "replace").decode("utf-8")
    return message


def dumps(obj: object) -> bytes:
    return orjson.dumps(obj)


def openai_error(status: int, message: str, code: ErrorCode | None) -> dict[str, object]:
    return {"message": cut(message), "type": openai_type(status), "param": None, "code": code}


def openai_error_body(status: int, message: str, code: ErrorCode | None = None) -> bytes:
    return dumps({"error": openai_error(status, message, code)})


def anthropic_error_body(status: int, message: str) -> bytes:
    return dumps({"type": "error", "error": {"type": anthropic_type(status), "message": cut(message)}})


def _status_of(value: object) -> int | None:
    if type(value) is int:
        status = value
    elif isinstance(value, str) and value.isdigit() and len(value) == 3:
        status = int(value)
    else:
        return None
    return status if 400 <= status <= 599 else None


def _find_status(sources: tuple[dict[str, object], ...]) -> int:
    for source in sources:
        for key in _STATUS_KEYS:
            status = _status_of(source.get(key))
            if status is not None:
                return status
    for source in sources:
        for key in ("type", "error_type", "code"):
            name = source.get(key)
            if isinstance(name, str) and name in _TYPE_STATUS:
                return _TYPE_STATUS[name]
    return 502


def _detail_message(detail: object) -> str | None:
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):  # FastAPI validation errors: [{"loc": [...], "msg": "...", ...}]
        msgs = [item["msg"] for item in detail if isinstance(item, dict) and isinstance(item.get("msg"), str)]
        if msgs:
            return "; ".join(msgs)
    if detail is not None:
        return dumps(detail).decode()
    return None


def error_message(obj: dict[str, object]) -> str | None:
    """The upstream's own message from an error object in any backend's shape, if it has one."""
    err = obj.get("error")
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return cut(err["message"])
    if isinstance(err, str) and err:
        return cut(err)
    if isinstance(obj.get("message"), str):
        return cut(str(obj["message"]))
    if "detail" in obj:
        detail = _detail_message(obj["detail"])
        return None if detail is None else cut(detail)
    return None


def describe_error(obj: dict[str, object]) -> ErrorInfo:
    """Status, message and code of an error object in any backend's shape."""
    err = obj.get("error")
    sources: tuple[dict[str, object], ...] = (err, obj) if isinstance(err, dict) else (obj,)
    message = error_message(obj)
    code: ErrorCode | None = None
    for source in sources:
        value = source.get("code")
        if (isinstance(value, str) and value) or (type(value) is int):
            code = value
            break
    status = _find_status(sources)
    return ErrorInfo(status, cut(message or f"upstream error (HTTP {status})"), code)


def is_error_object(obj: dict[str, object]) -> bool:
    """An error in any backend's shape (and not a success object that merely has an `error` field)."""
    if obj.get("object") == "error" or obj.get("type") == "error":
        return True
    if not _SUCCESS_KEYS.isdisjoint(obj) or obj.get("object") == "response":
        return False
    return bool(obj.get("error")) or "detail" in obj or isinstance(obj.get("message"), str)


def text_message(body: bytes) -> str | None:
    """An HTML page's `<title>`, else the first non-empty line of the text (tags stripped)."""
    match = _TITLE.search(body)
    if match:
        title = _SPACE.sub(" ", html.unescape(match.group(1).decode("utf-8", "replace"))).strip()
        if title:
            return cut(title)
    for line in body.decode("utf-8", "replace").splitlines():
        text = _SPACE.sub(" ", html.unescape(_TAG.sub("", line))).strip()
        if text:
            return cut(text)
    return None
