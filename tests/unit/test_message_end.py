"""Where a request ends (proxy.core.message_end), fed whole, at every split, and one byte at a time."""

from __future__ import annotations

import pytest

from proxy.core.http_head import head_refusal
from proxy.core.message_end import MessageEnd

GET = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
SIZED = b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n\r\n\r\n!"
CHUNKED = b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n4;a=b\r\n\r\n\r\n\r\n0\r\nT: 1\r\n\r\n"
FRAMING = {GET: (None, False), SIZED: (5, False), CHUNKED: (None, True)}


def _ends(stream: bytes, messages: list[bytes], pieces: list[bytes]) -> list[int]:
    """Feed `pieces` as the connection does; the stream offsets where a cut fell on a message's end."""
    cutter, at, ends = MessageEnd(), 0, []
    boundaries = {sum(len(m) for m in messages[: i + 1]) for i in range(len(messages))}
    heads = {sum(len(m) for m in messages[:i]) + m.index(b"\r\n\r\n") + 4: m for i, m in enumerate(messages)}
    for piece in pieces:
        view = memoryview(piece)
        while view:
            size = cutter.cut(view)
            assert 0 < size <= len(view)
            at += size
            view = view[size:]
            if at in heads:  # llhttp's on_headers_complete, as the shell relays it
                cutter.framed(*FRAMING[heads[at]])
            if at in boundaries:  # and its on_message_complete
                cutter.ended()
                ends.append(at)
    assert at == len(stream)
    return ends


@pytest.mark.parametrize("split", range(1, len(GET + SIZED + CHUNKED)))
def test_each_request_is_cut_at_its_end_at_any_split(split: int) -> None:
    messages = [GET, SIZED, CHUNKED, GET]
    stream = b"".join(messages)
    expected = [sum(len(m) for m in messages[: i + 1]) for i in range(len(messages))]
    assert _ends(stream, messages, [stream[:split], stream[split:]]) == expected


def test_each_request_is_cut_at_its_end_whole_and_byte_by_byte() -> None:
    messages = [CHUNKED, GET, SIZED] * 3
    stream = b"".join(messages)
    expected = [sum(len(m) for m in messages[: i + 1]) for i in range(len(messages))]
    assert _ends(stream, messages, [stream]) == expected
    assert _ends(stream, messages, [stream[i : i + 1] for i in range(len(stream))]) == expected


def test_a_read_of_many_tiny_requests_is_cut_after_the_first() -> None:
    cutter = MessageEnd()
    assert cutter.cut(GET * 1000) == len(GET)


def test_an_unparsable_chunk_line_stops_the_walk() -> None:
    """llhttp rejects that request; the walk feeds the rest rather than guess."""
    cutter = MessageEnd()
    cutter.framed(None, True)
    assert cutter.cut(b"zz\r\nabc\r\n0\r\n\r\n" + GET) == len(b"zz\r\nabc\r\n0\r\n\r\n" + GET)


@pytest.mark.parametrize(
    ("method", "version", "target", "headers", "status"),
    [
        ("TRACE", (1, 1), "/", [("Host", "x")], 405),
        ("GET", (2, 0), "/", [("Host", "x")], 505),
        ("GET", (1, 1), "/", [], 400),
        ("GET", (1, 0), "/", [], None),
        ("GET", (1, 1), "/", [("Host", "x"), ("host", "y")], 400),
        ("GET", (1, 1), "http://u:p@x/", [("Host", "x")], 400),
        ("GET", (1, 1), "http://x/?a=b@c", [("Host", "x")], None),
        ("GET", (1, 1), "/a@b", [("Host", "x")], None),
        ("POST", (1, 1), "/", [("Host", "x"), ("Expect", "100-continue"), ("Expect", "100-continue")], 400),
        ("POST", (1, 1), "/", [("Host", "x"), ("Transfer-Encoding", "gzip")], 501),
        ("POST", (1, 1), "/", [("Host", "x"), ("Transfer-Encoding", "gzip, chunked")], 501),
        ("POST", (1, 1), "/", [("Host", "x"), ("Transfer-Encoding", "Chunked")], None),
    ],
)
def test_heads_nginx_refuses(
    method: str, version: tuple[int, int], target: str, headers: list[tuple[str, str]], status: int | None
) -> None:
    refusal = head_refusal(method, version, target, headers)
    assert (refusal[0] if refusal else None) == status
