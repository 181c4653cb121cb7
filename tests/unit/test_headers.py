"""The request header and framing rules at the proxy boundary (sans-IO)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
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


def _by_multidict_operations(
    headers: CIMultiDictProxy[str], client_ip: str | None, host: str | None, identity: bool, authorization: str | None
) -> list[tuple[str, str]]:
    """The rules as the multidict operations they were first written as (the reference)."""
    drop = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
            "host", "content-length", "expect"}  # fmt: skip
    for value in headers.getall("Connection", ()):
        drop.update(token.strip().lower() for token in value.split(",") if token.strip())
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if name.lower() not in drop and "_" not in name:
            out.add(name, value)
    if client_ip:
        prior = ", ".join(out.getall("X-Forwarded-For", ()))
        out.popall("X-Forwarded-For", None)
        out["X-Forwarded-For"] = f"{prior}, {client_ip}" if prior else client_ip
    out.setdefault("X-Forwarded-Proto", "http")
    if host:
        out.setdefault("X-Forwarded-Host", host)
    out["X-Request-Id"] = "r1"
    if identity:
        out.popall("Accept-Encoding", None)
    if authorization and "Authorization" not in out:
        out["Authorization"] = authorization
    return list(out.items())


_NAMES = ["Host", "Connection", "x-forwarded-for", "X-Forwarded-For", "X-Forwarded-Proto", "x-forwarded-host",
          "X-Request-Id", "x-request-id", "Authorization", "Accept-Encoding", "X_Forwarded_For", "Keep-Alive",
          "Content-Type", "X-Custom", "TE", "keep-alive", "x_custom", "Content-Length", "content-encoding"]  # fmt: skip
_VALUES = ["a", "b, c", "x-custom", "authorization, keep-alive", "accept-encoding", "close", ""]


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(_NAMES), st.sampled_from(_VALUES)), max_size=12),
    st.sampled_from([None, "", "10.0.0.1"]), st.sampled_from([None, "", "x:8080"]), st.booleans(),
    st.sampled_from([None, "", "Basic dTpw"]),
)
def test_request_headers_are_what_the_multidict_operations_give_in_their_order(
    pairs: list[tuple[str, str]], client_ip: str | None, host: str | None, identity: bool, authorization: str | None
) -> None:
    headers = CIMultiDictProxy(CIMultiDict(pairs))
    got = request_headers(headers, client_ip=client_ip, scheme="http", host=host, request_id="r1",
                          identity=identity, authorization=authorization)  # fmt: skip
    assert list(got.items()) == _by_multidict_operations(headers, client_ip, host, identity, authorization)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_NAMES), st.sampled_from(_VALUES)), max_size=8), st.booleans())
def test_response_headers_are_the_upstreams_less_what_is_dropped_in_their_order(
    pairs: list[tuple[str, str]], rewritten: bool
) -> None:
    headers = CIMultiDictProxy(CIMultiDict(pairs))
    drop = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}
    if rewritten:
        drop |= {"content-length", "content-encoding", "content-type"}
    for value in headers.getall("Connection", ()):
        drop.update(token.strip().lower() for token in value.split(",") if token.strip())
    want = [(name, value) for name, value in headers.items() if name.lower() not in drop]
    assert list(response_headers(headers, body_rewritten=rewritten).items()) == want
