"""The bench's sans-IO response reader, at every split point, and the abandon test's seeded plan."""

from __future__ import annotations

import pytest

from proxy.tools.bench.cancel import abandon_plan
from proxy.tools.bench.client import ProtocolError, ResponseReader, build_request


def _event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


def _chunked(*events: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
    return head + body + b"0\r\n\r\n"


ROLE = _event(b'{"choices":[{"delta":{"role":"assistant","content":""}}]}')
CONTENT = _event(b'{"choices":[{"delta":{"content":"Hi"}}]}')
DONE = _event(b"[DONE]")
STREAM = _chunked(ROLE, CONTENT, CONTENT, DONE)


def _feed(data: bytes, split: int) -> tuple[ResponseReader, bytes]:
    """The two halves at times 1.0 and 2.0 (the request went out at 0.0)."""
    reader = ResponseReader(0.0)
    rest = reader.feed(data[:split], 1.0) if split else b""
    if not reader.exchange.done:
        rest = reader.feed(data[split:], 2.0)
    return reader, rest


@pytest.mark.parametrize("split", range(len(STREAM) + 1))
def test_a_chunked_stream_at_every_split(split: int) -> None:
    reader, rest = _feed(STREAM, split)
    ex = reader.exchange
    assert (ex.status, ex.events, ex.done, rest) == (200, 4, True, b"")
    head_end = STREAM.index(b"\r\n\r\n") + 4
    role_end = STREAM.index(ROLE) + len(ROLE)
    content_seen = STREAM.index(b'"Hi"') + 2  # the first character of content
    assert ex.ttfb == (1.0 if split else 2.0)
    assert ex.ttfe == (1.0 if split >= role_end else 2.0)
    assert ex.ttft == (1.0 if split >= content_seen else 2.0)  # the role chunk's empty content is no content
    assert ex.total == 2.0 if split < len(STREAM) else ex.total == 1.0
    assert split >= head_end or ex.ttfb is not None


def test_events_counted_across_separate_reads_and_a_pipelined_surplus() -> None:
    reader = ResponseReader(0.0)
    for i, byte in enumerate(STREAM):
        reader.feed(bytes([byte]), float(i))
    assert reader.exchange.events == 4
    assert reader.exchange.done
    again = ResponseReader(0.0)
    assert again.feed(STREAM + b"HTTP/1.1 200", 1.0) == b"HTTP/1.1 200"


@pytest.mark.parametrize("split", range(0, 80, 7))
def test_a_whole_body_with_content_length(split: int) -> None:
    body = b'{"choices":[{"message":{"role":"assistant","content":"Hello"}}]}'
    data = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
    reader, rest = _feed(data, split)
    ex = reader.exchange
    assert (ex.status, ex.done, ex.keep_alive, ex.events, rest) == (200, True, False, 0, b"")
    assert ex.ttft is not None
    assert ex.ttfe == ex.ttft


def test_an_unfinished_stream_is_not_done() -> None:
    reader = ResponseReader(0.0)
    reader.feed(STREAM[:-5], 1.0)
    assert not reader.exchange.done
    assert reader.exchange.total is None


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "bad status line"),
        (b"HTTP/1.1 200 OK\r\n\r\n", "neither Content-Length nor chunked"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY", "not followed by CRLF"),
    ],
)
def test_a_response_it_cannot_read_is_an_error(data: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        ResponseReader(0.0).feed(data + b"\r\n", 1.0)


def test_build_request_has_the_length_and_extra_headers() -> None:
    request = build_request("h:1", "/v1/chat/completions", b"{}", {"X-Request-Id": "r1"})
    assert request == (b"POST /v1/chat/completions HTTP/1.1\r\nHost: h:1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 2\r\nX-Request-Id: r1\r\n\r\n{}")  # fmt: skip


def test_the_abandon_plan_is_a_seeded_third() -> None:
    plan = abandon_plan(300, seed=1, tokens=100)
    assert len(plan) == 100
    assert all(0 <= i < 300 and 1 <= after <= 100 for i, after in plan.items())
    assert plan == abandon_plan(300, seed=1, tokens=100)
    assert plan != abandon_plan(300, seed=2, tokens=100)
