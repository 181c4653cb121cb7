"""Error shapes: status -> type tables (design section 10) and reading errors in any backend's shape."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.core.dialects.errors import (
    ErrorInfo,
    anthropic_type,
    cut,
    describe_error,
    is_error_object,
    openai_type,
    responses_code,
    text_message,
)


@pytest.mark.parametrize(
    ("status", "openai", "anthropic", "responses"),
    [
        (400, "invalid_request_error", "invalid_request_error", "invalid_prompt"),
        (401, "authentication_error", "authentication_error", "invalid_prompt"),
        (403, "permission_error", "permission_error", "invalid_prompt"),
        (404, "invalid_request_error", "not_found_error", "invalid_prompt"),
        (409, "invalid_request_error", "invalid_request_error", "invalid_prompt"),
        (413, "invalid_request_error", "request_too_large", "invalid_prompt"),
        (422, "invalid_request_error", "invalid_request_error", "invalid_prompt"),
        (429, "rate_limit_error", "rate_limit_error", "rate_limit_exceeded"),
        (500, "server_error", "api_error", "server_error"),
        (502, "server_error", "api_error", "server_error"),
        (503, "server_error", "overloaded_error", "server_error"),
        (504, "timeout_error", "timeout_error", "server_error"),
        (529, "server_error", "overloaded_error", "server_error"),
        (599, "server_error", "api_error", "server_error"),
    ],
)
def test_type_by_status(status: int, openai: str, anthropic: str, responses: str) -> None:
    assert openai_type(status) == openai
    assert anthropic_type(status) == anthropic
    assert responses_code(status) == responses


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        ({"error": {"message": "m", "type": "BadRequestError", "code": 400}}, ErrorInfo(400, "m", 400)),
        ({"error": {"message": "m", "code": "400"}}, ErrorInfo(400, "m", "400")),
        ({"error": {"message": "m", "code": 200}}, ErrorInfo(502, "m", 200)),  # the code carried, not the status
        ({"error": {"message": "m", "code": 1000}}, ErrorInfo(502, "m", 1000)),
        ({"error": {"message": "m", "code": True}}, ErrorInfo(502, "m", None)),
        ({"error": {"message": "m", "http_status_code": 424}}, ErrorInfo(424, "m", None)),
        ({"error": {"message": "m", "code": "bad_thing"}, "status": 503}, ErrorInfo(503, "m", "bad_thing")),
        ({"object": "error", "message": "m", "code": 429}, ErrorInfo(429, "m", 429)),
        ({"error": "m", "error_type": "overloaded"}, ErrorInfo(502, "m", None)),
        ({"type": "error", "error": {"type": "not_found_error", "message": "m"}}, ErrorInfo(404, "m", None)),
        ({"type": "error", "error": {"type": "overloaded_error", "message": "m"}}, ErrorInfo(529, "m", None)),
        ({"error": {"code": "rate_limit_exceeded", "message": "m"}}, ErrorInfo(429, "m", "rate_limit_exceeded")),
        ({"detail": "m"}, ErrorInfo(502, "m", None)),
        ({"detail": [{"msg": "a"}, {"msg": "b"}, "junk"]}, ErrorInfo(502, "a; b", None)),
        ({"detail": {"reason": "x"}}, ErrorInfo(502, '{"reason":"x"}', None)),
        ({"message": "m", "status_code": 500}, ErrorInfo(500, "m", None)),
        ({"error": {"message": ""}}, ErrorInfo(502, "upstream error (HTTP 502)", None)),
        ({"error": True}, ErrorInfo(502, "upstream error (HTTP 502)", None)),
    ],
)
def test_describe_error(obj: dict[str, Any], expected: ErrorInfo) -> None:
    assert describe_error(obj) == expected


def test_describe_error_cuts_the_message() -> None:
    assert len(describe_error({"error": "x" * 1000}).message) == 500


@pytest.mark.parametrize(
    ("obj", "is_error"),
    [
        ({"error": {"message": "m"}}, True),
        ({"error": "m"}, True),
        ({"object": "error", "message": "m"}, True),
        ({"type": "error", "error": {}}, True),
        ({"detail": "m"}, True),
        ({"message": "m"}, True),
        ({"choices": [], "error": None}, False),
        ({"choices": [], "message": "m"}, False),
        ({"object": "response", "status": "failed", "error": {"code": "server_error", "message": "m"}}, False),
        ({"type": "message", "content": []}, False),
        ({"object": "list", "data": []}, False),
        ({}, False),
        ({"error": None}, False),
    ],
)
def test_is_error_object(obj: dict[str, Any], is_error: bool) -> None:
    assert is_error_object(obj) is is_error


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"<html><head><TITLE>\n  503   Service\nUnavailable </TITLE></head></html>", "503 Service Unavailable"),
        (b"<title></title>\n<p>Real text</p>", "Real text"),
        (b"<!doctype html>\n<html>\n<body>\n<p>Gateway &lt;timeout&gt;</p>", "Gateway <timeout>"),
        (b"\n   \nfirst\nsecond", "first"),
        (b"caf\xc3\xa9 \xff broken", "caf\u00e9 \ufffd broken"),
        (b"", None),
        (b"<html></html>", None),
    ],
)
def test_text_message(body: bytes, message: str | None) -> None:
    assert text_message(body) == message


def test_cut_makes_text_encodable() -> None:
    assert cut("a\ud800b") == "a?b"
    assert cut("y" * 501) == "y" * 500
