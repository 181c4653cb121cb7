"""The request header and framing rules at the proxy boundary (sans-IO)."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.core.headers import request_headers, response_headers
from proxy.core.http_head import HeadScanner, framing_error, request_line_refusal


def _forwarded(*pairs: tuple[str, str]) -> CIMultiDict[str]:
    headers = CIMultiDictProxy(CIMultiDict(pairs))
    return request_headers(headers, client_ip="10.0.0.1", scheme="http", host="x", request_id="r1")


def test_request_header_names_with_underscores_are_dropped() -> None:
    out = _forwarded(("X_Api_Key", "smuggled"), ("X-Api-Key", "real"), ("user_agent", "a"), ("Accept", "*/*"))
    assert "X_Api_Key" not in out
    assert "user_agent" not in out
    assert out.getall("X-Api-Key") == ["real"]
    assert out["Accept"] == "*/*"


def test_response_header_names_with_underscores_pass() -> None:
    """nginx's rule is about what clients send; a backend's own response headers go back as they came."""
    out = response_headers(CIMultiDictProxy(CIMultiDict([("X_Backend", "1")])), body_rewritten=False)
    assert out["X_Backend"] == "1"


def test_transfer_encoding_is_refused_on_http10_only() -> None:
    assert framing_error((1, 0), "chunked") is not None
    assert framing_error((1, 0), None) is None
    assert framing_error((1, 1), "chunked") is None


@pytest.mark.parametrize(
    ("line", "status"),
    [
        (b"GET /v1/models HTTP/2.0", 505),
        (b"PRI * HTTP/2.0", 505),  # an h2 preface on the HTTP/1 port
        (b"TRACE /v1/models HTTP/1.1", 405),
        (b"GET /v1/models HTTP/1.1", None),
        (b"POST /v1/chat/completions HTTP/1.0", None),
        (b"GET /v1/models", None),  # malformed: the parser's 400
    ],
)
def test_request_lines_nginx_refuses(line: bytes, status: int | None) -> None:
    refusal = request_line_refusal(line)
    assert (refusal[0] if refusal else None) == status


@pytest.mark.parametrize("split", range(1, 30))
def test_the_request_line_is_found_at_any_split(split: int) -> None:
    head = b"\r\nTRACE /x HTTP/1.1\r\nHost: x\r\n\r\n"
    scanner = HeadScanner(1024)
    scanner.feed(head[:split])
    assert scanner.feed(head[split:])
    assert scanner.request_line == b"TRACE /x HTTP/1.1"
