"""The request header and framing rules at the proxy boundary (sans-IO)."""

from __future__ import annotations

from multidict import CIMultiDict, CIMultiDictProxy

from proxy.core.headers import request_headers, response_headers
from proxy.core.http_head import framing_error


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
