"""Where a request ends (proxy.core.message_end), fed whole, at every split, and one byte at a time."""

from __future__ import annotations

import pytest

from proxy.core.http_head import head_refusal
from proxy.core.message_end import Framing, MessageEnd

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
        offset = 0
        while offset < len(piece):
            end = cutter.cut(piece, offset)
            assert offset < end <= len(piece)
            at += end - offset
            offset = end
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


# Lines llhttp accepts however long (nginx too): a 5 KB and a 200 KB chunk extension, 5,000 leading
# zeros, a 5 KB trailer. The walk keeps none of it and still cuts at the request's end.
_TE = b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
LONG_LINES = [
    _TE + b"3;e=" + b"a" * 5000 + b"\r\nabc\r\n0\r\n\r\n",
    _TE + b"3;e=" + b"a" * 200_000 + b"\r\nabc\r\n0\r\n\r\n",
    _TE + b"0" * 5000 + b"3\r\nabc\r\n0\r\n\r\n",
    _TE + b"3\r\nabc\r\n0\r\nT: " + b"a" * 5000 + b"\r\n\r\n",
    _TE + b"00010\r\n" + b"d" * 16 + b"\r\n0;x\r\n\r\n",
]


@pytest.mark.parametrize("message", LONG_LINES, ids=["ext-5k", "ext-200k", "zeros-5k", "trailer-5k", "zeros-16"])
def test_long_lines_llhttp_accepts_are_walked_to_the_requests_end(message: bytes) -> None:
    """Before, a chunk-size or trailer line past 4,096 bytes stopped the walk and the whole rest of the
    read went to llhttp: every pipelined request behind it parsed at once (682,000 on one client)."""
    FRAMING[message] = (None, True)
    stream = message + GET * 100
    messages = [message] + [GET] * 100
    expected = [sum(len(m) for m in messages[: i + 1]) for i in range(len(messages))]
    try:
        assert _ends(stream, messages, [stream]) == expected
        assert _ends(stream, messages, [stream[i : i + 997] for i in range(0, len(stream), 997)]) == expected
        for split in (len(_TE) + 2, len(message) // 2, len(message) - 1):  # inside the long line, and at its end
            assert _ends(stream, messages, [stream[:split], stream[split:]]) == expected
    finally:
        del FRAMING[message]


def test_the_walk_keeps_no_part_of_a_long_line() -> None:
    cutter = MessageEnd()
    cutter.framed(None, True)
    for _ in range(1000):  # a megabyte of extension, a kilobyte at a time
        assert cutter.cut(b"e" * 1024 if _ else b"3;" + b"e" * 1022) == 1024
    assert cutter.state is Framing.EXTENSION


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"zz\r\nabc\r\n0\r\n\r\n", id="no-digit"),
        pytest.param(b";e\r\nabc\r\n0\r\n\r\n", id="extension-without-size"),
        pytest.param(b"1" + b"0" * 16 + b"\r\nabc\r\n0\r\n\r\n", id="size-past-64-bits"),
        pytest.param(b"f" * 100_000 + b"\r\nabc\r\n0\r\n\r\n", id="100k-digits"),
        pytest.param(b"3\r\nabc\r\n0\r\n\rX\r\n\r\n", id="cr-without-lf"),
    ],
)
def test_bytes_llhttp_rejects_are_fed_a_line_at_a_time(body: bytes) -> None:
    """llhttp rejects the request; until it does, no feed holds more than one line, so no feed can
    hold more than one pipelined request behind it."""
    cutter = MessageEnd()
    cutter.framed(None, True)
    data = body + GET * 100
    at, pieces = 0, []
    while at < len(data):
        end = cutter.cut(data, at)
        assert at < end <= len(data)
        pieces.append(data[at:end])
        at = end
    assert cutter.state is Framing.UNKNOWN
    assert b"GET" not in pieces[0]  # (the first feed ends at the line llhttp rejects)
    assert all(piece.count(b"\n") <= 1 for piece in pieces[1:])


def test_a_chunk_size_of_sixteen_digits_is_walked() -> None:
    """llhttp's chunk size is a uint64: 16 significant digits are a size (leading zeros are not digits)."""
    cutter = MessageEnd()
    cutter.framed(None, True)
    data = b"0000" + b"7" + b"f" * 15 + b";x\r\n" + b"abc"
    assert cutter.cut(data) == len(data)
    assert cutter.state is Framing.DATA


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
