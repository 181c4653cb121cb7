"""The SSE reader against a table of streams, fed whole, byte by byte and split at every point, and
against a deliberately naive reference parser on random streams (hypothesis)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.sse import Event, EventTooLarge, SSEReader, StatusBlock

BOM = b"\xef\xbb\xbf"
Item = Event | StatusBlock
FAST = settings(max_examples=300, deadline=None, derandomize=True, database=None)


@dataclass
class Outcome:
    fed: list[Item]  # items returned by feed()
    pending: int  # reader.pending just before close()
    closed: list[Item]  # items returned by close()


def run(chunks: Sequence[bytes], max_event_size: int = 1 << 20) -> Outcome:
    reader = SSEReader(max_event_size)
    fed: list[Item] = []
    for chunk in chunks:
        fed += reader.feed(chunk)
    pending = reader.pending
    return Outcome(fed, pending, reader.close())


def canonical(stream: bytes, out: Outcome) -> tuple[list[Item], int]:
    """Items and pending bytes as if a CR-LF pair cut by a chunk boundary had stayed together.

    The reader dispatches a block ending in CR at once and puts a following LF at the start of the
    next item, or of the partial event still pending, or returns it alone (from close(), or before a
    status block); fed whole, the LF stays with the CR. Everything else must be identical, so other
    lone-LF items (blank lines) are never merged.
    """
    items: list[Item] = []
    seq = out.fed + out.closed
    for n, item in enumerate(seq):
        if item.raw.startswith(b"\n") and items and items[-1].raw.endswith(b"\r"):
            # a lone LF handed back by close(), or before a status block that ended a partial event
            before_status = any(isinstance(i, StatusBlock) for i in seq[n + 1 : n + 2])
            if len(item.raw) == 1 and (n == len(out.fed) or before_status):
                items[-1] = dataclasses.replace(items[-1], raw=items[-1].raw + b"\n")
                continue
            if len(item.raw) > 1:
                items[-1] = dataclasses.replace(items[-1], raw=items[-1].raw + b"\n")
                item = dataclasses.replace(item, raw=item.raw[1:])
        items.append(item)
    fed = b"".join(i.raw for i in out.fed)
    lf_pending = strip_bom(stream)[len(fed) :].startswith(b"\n") and out.closed[:1] != [Event(b"\n")]
    if out.pending > 1 and fed.endswith(b"\r") and lf_pending:
        last = len(items) - len(out.closed) - 1  # close() returned no lone LF: the LF is pending
        items[last] = dataclasses.replace(items[last], raw=items[last].raw + b"\n")
        return items, out.pending - 1
    return items, out.pending


def splittings(stream: bytes) -> Iterator[list[bytes]]:
    """Whole, one byte at a time, and cut once at every offset (the ends give an empty feed)."""
    yield [stream]
    yield [stream[i : i + 1] for i in range(len(stream))]
    for i in range(len(stream) + 1):
        yield [stream[:i], stream[i:]]


def strip_bom(stream: bytes) -> bytes:
    return stream[len(BOM) :] if stream.startswith(BOM) else stream


# --- the reference: WHATWG "parsing an event stream", written for clarity, whole input only ---------


def reference(stream: bytes) -> tuple[list[Event], bytes]:
    """Blocks of a whole stream and the trailing partial block; every blank line makes a block."""
    stream = strip_bom(stream)
    events: list[Event] = []
    lines: list[bytes] = []
    block_start = line_start = i = 0
    while i < len(stream):
        byte = stream[i : i + 1]
        if byte not in (b"\r", b"\n"):
            i += 1
            continue
        line = stream[line_start:i]
        i += 2 if stream[i : i + 2] == b"\r\n" else 1
        line_start = i
        if line:
            lines.append(line)
        else:
            events.append(interpret(stream[block_start:i], lines))
            lines, block_start = [], i
    return events, stream[block_start:]


def interpret(raw: bytes, lines: list[bytes]) -> Event:
    event: str | None = None
    ident: str | None = None
    retry: str | None = None
    data, has_data = b"", False
    for line in lines:
        if line.startswith(b":"):
            continue
        if b":" in line:
            name, value = line.split(b":", 1)
            if value.startswith(b" "):
                value = value[1:]
        else:
            name, value = line, b""
        if name == b"data":
            data += value + b"\n"
            has_data = True
        elif name == b"event":
            event = value.decode("utf-8", "replace")
        elif name == b"id" and b"\x00" not in value:
            ident = value.decode("utf-8", "replace")
        elif name == b"retry" and value and all(c in b"0123456789" for c in value):
            retry = value.decode()
    return Event(raw, event, data[:-1], has_data, ident, retry)


# --- the table ---------------------------------------------------------------------------------------


def ev(raw: bytes, **fields: object) -> Event:
    return Event(raw, **fields)  # type: ignore[arg-type]


def d(raw: bytes, data: bytes, **fields: object) -> Event:
    return ev(raw, data=data, has_data=True, **fields)


JSON_BODY = b'{"error": {"message": "busy"}}'
CASES: list[tuple[str, bytes, list[Item], int]] = [
    ("lf", b"data: a\n\ndata: b\n\n", [d(b"data: a\n\n", b"a"), d(b"data: b\n\n", b"b")], 0),
    (
        "crlf",
        b"data: a\r\n\r\nevent: e\r\ndata: b\r\n\r\n",
        [d(b"data: a\r\n\r\n", b"a"), d(b"event: e\r\ndata: b\r\n\r\n", b"b", event="e")],
        0,
    ),
    ("cr", b"data: a\r\rdata: b\r\r", [d(b"data: a\r\r", b"a"), d(b"data: b\r\r", b"b")], 0),
    (
        "mixed",
        b"data: a\r\ndata: b\n\rid: 1\r\r\n",
        [d(b"data: a\r\ndata: b\n\r", b"a\nb"), ev(b"id: 1\r\r\n", id="1")],
        0,
    ),
    ("multiline", b"data: a\ndata:b\ndata:  c\n\n", [d(b"data: a\ndata:b\ndata:  c\n\n", b"a\nb\n c")], 0),
    ("colon_in_value", b"data: a: b\n\n", [d(b"data: a: b\n\n", b"a: b")], 0),
    (
        "comments",
        b": keep-alive\n\n:\n\n: x\ndata: y\n\n",
        [ev(b": keep-alive\n\n"), ev(b":\n\n"), d(b": x\ndata: y\n\n", b"y")],
        0,
    ),
    (
        "event_id_retry",
        b"event: upd\nid: 42\nretry: 3000\ndata: {}\n\n",
        [d(b"event: upd\nid: 42\nretry: 3000\ndata: {}\n\n", b"{}", event="upd", id="42", retry="3000")],
        0,
    ),
    (
        "invalid_retry",
        b"retry: 30a\ndata: x\n\nretry:\n\nretry: -1\nretry: 7\nretry: 1.5\n\n",
        [d(b"retry: 30a\ndata: x\n\n", b"x"), ev(b"retry:\n\n"), ev(b"retry: -1\nretry: 7\nretry: 1.5\n\n", retry="7")],
        0,
    ),
    (
        "id_with_nul",
        b"id: a\x00b\ndata: x\n\nid: 1\nid: 2\x00\n\nid\n\n",
        [d(b"id: a\x00b\ndata: x\n\n", b"x"), ev(b"id: 1\nid: 2\x00\n\n", id="1"), ev(b"id\n\n", id="")],
        0,
    ),
    (
        "field_without_colon",
        b"data\n\nevent\ndata: x\n\nfoo\n\n",
        [d(b"data\n\n", b""), d(b"event\ndata: x\n\n", b"x", event=""), ev(b"foo\n\n")],
        0,
    ),
    ("bom", BOM + b"data: a\n\n", [d(b"data: a\n\n", b"a")], 0),
    ("second_bom_kept", BOM + BOM + b"data: a\n\n", [ev(BOM + b"data: a\n\n")], 0),
    ("bom_alone", BOM, [], 0),
    ("bom_prefix_only", BOM[:2], [], 2),
    (
        "empty_data_lines",
        b"data:\n\ndata: \n\ndata\ndata\n\n",
        [d(b"data:\n\n", b""), d(b"data: \n\n", b""), d(b"data\ndata\n\n", b"\n")],
        0,
    ),
    (
        "doubled_blank_lines",
        b"\ndata: a\n\n\n\r\n\rdata: b\n\n",
        [ev(b"\n"), d(b"data: a\n\n", b"a"), ev(b"\n"), ev(b"\r\n"), ev(b"\r"), d(b"data: b\n\n", b"b")],
        0,
    ),
    (
        "unicode_event",
        b"event: caf\xc3\xa9\nevent: \xff\n\n",
        [ev(b"event: caf\xc3\xa9\nevent: \xff\n\n", event="\ufffd")],
        0,
    ),
    ("utf8_event", b"event: caf\xc3\xa9\n\n", [ev(b"event: caf\xc3\xa9\n\n", event="caf\u00e9")], 0),
    ("partial_tail", b"data: a\n\ndata: b\n", [d(b"data: a\n\n", b"a")], len(b"data: b\n")),
    ("partial_cr", b"data: a\r", [], len(b"data: a\r")),
    ("cr_then_lf_at_eof", b"data: a\r\r\n", [d(b"data: a\r\r\n", b"a")], 0),
    ("cr_then_lf_then_partial", b"data: a\r\r\ndata: b", [d(b"data: a\r\r\n", b"a")], len(b"data: b")),
    (
        "data_with_http_text",
        b"data: HTTP/1.1 500 Internal Server Error\n\ndata:HTTP/1.0 200 OK\n\n",
        [
            d(b"data: HTTP/1.1 500 Internal Server Error\n\n", b"HTTP/1.1 500 Internal Server Error"),
            d(b"data:HTTP/1.0 200 OK\n\n", b"HTTP/1.0 200 OK"),
        ],
        0,
    ),
    (
        "not_a_status_line",
        b"HTTP/1.1 50x Oops\n\nHTTP/2 500\n\nHTTP/1.2 500 X\n\nxHTTP/1.1 500 X\n\n",
        [ev(b"HTTP/1.1 50x Oops\n\n"), ev(b"HTTP/2 500\n\n"), ev(b"HTTP/1.2 500 X\n\n"), ev(b"xHTTP/1.1 500 X\n\n")],
        0,
    ),
    (
        "status_content_length",
        b"data: 1\n\nHTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        + b"Content-Length: %d\r\n\r\n" % len(JSON_BODY)
        + JSON_BODY
        + b"data: 2\n\n",
        [
            d(b"data: 1\n\n", b"1"),
            StatusBlock(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                + b"Content-Length: %d\r\n\r\n" % len(JSON_BODY)
                + JSON_BODY,
                503,
                "Service Unavailable",
                {"content-type": "application/json", "content-length": str(len(JSON_BODY))},
                JSON_BODY,
            ),
            d(b"data: 2\n\n", b"2"),
        ],
        0,
    ),
    (
        "status_content_length_spans_blank_lines",
        b"HTTP/1.0 500 X\nContent-Length: 4\n\na\n\nbdata: 2\n\n",
        [
            StatusBlock(b"HTTP/1.0 500 X\nContent-Length: 4\n\na\n\nb", 500, "X", {"content-length": "4"}, b"a\n\nb"),
            d(b"data: 2\n\n", b"2"),
        ],
        0,
    ),
    (
        "status_blank_line_ends_body",
        b"HTTP/1.0 500 Internal Server Error\nRetry-After: 5\nX-Y: a\nx-y: b\n\n\r\n"
        + JSON_BODY
        + b"\r\n\r\ndata: after\n\n",
        [
            StatusBlock(
                b"HTTP/1.0 500 Internal Server Error\nRetry-After: 5\nX-Y: a\nx-y: b\n\n\r\n" + JSON_BODY + b"\r\n\r\n",
                500,
                "Internal Server Error",
                {"retry-after": "5", "x-y": "a, b"},
                b"\r\n" + JSON_BODY,
            ),
            d(b"data: after\n\n", b"after"),
        ],
        0,
    ),
    (
        "status_body_to_eof",
        b"HTTP/1.1 502 Bad Gateway\r\n\r\nupstream gone\n",
        [StatusBlock(b"HTTP/1.1 502 Bad Gateway\r\n\r\nupstream gone\n", 502, "Bad Gateway", {}, b"upstream gone\n")],
        0,
    ),
    (
        "status_mid_event",
        b"data: 0\n\nevent: x\ndata: partial\r\nHTTP/1.1 500\r\nContent-Length: 2\r\n\r\nhi",
        [
            d(b"data: 0\n\n", b"0"),
            StatusBlock(b"HTTP/1.1 500\r\nContent-Length: 2\r\n\r\nhi", 500, "", {"content-length": "2"}, b"hi"),
        ],
        0,
    ),
    (
        "status_headers_to_eof",
        b"data: x\nHTTP/1.1 500 Oops\r\nX-A: 1",
        [StatusBlock(b"HTTP/1.1 500 Oops\r\nX-A: 1", 500, "Oops", {"x-a": "1"}, b"")],
        len(b"data: x\n"),
    ),
    (
        "status_cr_at_eof",
        b"HTTP/1.1 500 X\r\n\r",
        [StatusBlock(b"HTTP/1.1 500 X\r\n\r", 500, "X", {}, b"")],
        0,
    ),
    (
        "status_after_cr_lf",
        b"data: a\r\r\nHTTP/1.1 500 X\n\nbody\n\n",
        [d(b"data: a\r\r\n", b"a"), StatusBlock(b"HTTP/1.1 500 X\n\nbody\n\n", 500, "X", {}, b"body")],
        0,
    ),
    (
        "status_after_cr_lf_and_partial_to_eof",
        b"data: a\r\r\ndata: p\nHTTP/1.1 500 X",
        [d(b"data: a\r\r\n", b"a"), StatusBlock(b"HTTP/1.1 500 X", 500, "X", {}, b"")],
        len(b"data: p\n"),
    ),
    (
        "status_truncated_content_length",
        b"HTTP/1.1 500 X\r\nContent-Length: 10\r\n\r\nabc",
        [StatusBlock(b"HTTP/1.1 500 X\r\nContent-Length: 10\r\n\r\nabc", 500, "X", {"content-length": "10"}, b"abc")],
        0,
    ),
]


@pytest.mark.parametrize(("stream", "expected", "pending"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_table_whole(stream: bytes, expected: list[Item], pending: int) -> None:
    out = run([stream])
    assert out.fed + out.closed == expected
    assert out.pending == pending


@pytest.mark.parametrize(("stream", "expected", "pending"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_table_every_chunking(stream: bytes, expected: list[Item], pending: int) -> None:
    for chunks in splittings(stream):
        out = run(chunks)
        assert canonical(stream, out) == (expected, pending), chunks
        if not any(isinstance(item, StatusBlock) for item in expected):
            whole = strip_bom(stream)
            assert b"".join(i.raw for i in out.fed + out.closed) == whole[: len(whole) - out.pending], chunks


def test_status_blocks_are_returned_as_soon_as_complete() -> None:
    reader = SSEReader()
    assert reader.feed(b"HTTP/1.1 500 X\nContent-Length: 2\n\nh") == []
    assert [type(i) for i in reader.feed(b"i")] == [StatusBlock]
    assert reader.feed(b"HTTP/1.1 503 Y\n\n\n{}\n") == []  # no Content-Length: wait for a blank line
    assert [i.body for i in reader.feed(b"\n")] == [b"\n{}"]  # type: ignore[union-attr]


def test_cr_dispatches_at_once_and_the_lf_leads_the_next_item() -> None:
    reader = SSEReader()
    assert reader.feed(b"data: a\r\r") == [d(b"data: a\r\r", b"a")]
    assert reader.feed(b"\n") == []
    assert reader.pending == 0  # the LF is not a partial event: close() hands it back
    assert reader.feed(b"data: b\n\n") == [d(b"\ndata: b\n\n", b"b")]
    assert reader.feed(b"data: c\r\r") == [d(b"data: c\r\r", b"c")]
    assert reader.feed(b"\n") == []
    assert reader.close() == [ev(b"\n")]


def test_the_lf_of_a_cut_crlf_is_kept_when_a_status_line_ends_the_partial_event() -> None:
    reader = SSEReader()
    assert reader.feed(b"data: a\r\r") == [d(b"data: a\r\r", b"a")]
    items = reader.feed(b"\ndata: partial\nHTTP/1.1 500 X\n\nbody\n\n")
    assert items == [ev(b"\n"), StatusBlock(b"HTTP/1.1 500 X\n\nbody\n\n", 500, "X", {}, b"body")]


def test_a_lone_cr_blank_line_is_dispatched_at_once() -> None:
    reader = SSEReader()
    assert reader.feed(b"\r") == [ev(b"\r")]
    assert reader.feed(b"\n\n") == [ev(b"\n\n")]  # CRLF's LF, then a blank line of its own


def test_many_events_in_one_chunk_and_one_event_in_many() -> None:
    events = [b'data: {"n": %d}\n\n' % i for i in range(50)]
    reader = SSEReader()
    assert [e.data for e in reader.feed(b"".join(events))] == [b'{"n": %d}' % i for i in range(50)]  # type: ignore[union-attr]
    big = b"data: " + b"x" * 5000 + b"\n\n"
    got: list[Item] = []
    for i in range(0, len(big), 7):
        got += reader.feed(big[i : i + 7])
        assert reader.pending == (0 if got else min(i + 7, len(big)))
    assert got == [d(big, b"x" * 5000)]


@pytest.mark.parametrize(
    "stream",
    [
        b"data: ok\n\ndata: " + b"x" * 100 + b"\n\n",
        b"data: ok\n\ndata: " + b"x" * 100,  # never completed: the buffer must not keep growing
        b"data: " + b"x" * 100 + b"\r\rdata: ok\n\n",
        b"HTTP/1.1 500 X\nContent-Length: 100\n\n" + b"x" * 100,
        b"HTTP/1.1 500 X\n\n" + b"x" * 100,
        b"HTTP/1.1 500 X\n" + b"x: y\n" * 30,
    ],
    ids=["complete", "partial", "cr", "status_content_length", "status_to_eof", "status_headers"],
)
def test_oversized_item_raises_at_every_chunking(stream: bytes) -> None:
    for chunks in splittings(stream):
        with pytest.raises(EventTooLarge):
            run(chunks, max_event_size=64)


def test_items_up_to_the_bound_pass() -> None:
    event = b"data: " + b"x" * 56 + b"\n\n"
    assert len(event) == 64
    for chunks in splittings(event * 2):
        assert canonical(event * 2, run(chunks, max_event_size=64)) == ([d(event, b"x" * 56)] * 2, 0)


def test_max_event_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        SSEReader(0)


# --- random streams -----------------------------------------------------------------------------------

# No "H": random streams never hold a status line, so the reference needs no status parser.
PIECES = [b"data", b"event", b"id", b"retry", b":", b" ", b"\r", b"\n", b"\r\n", b"x", b"7", b"\x00", b"\xc3\xa9"]
PIECES.append(b"\xff")
raw_streams = st.tuples(st.sampled_from([b"", BOM, BOM[:2]]), st.lists(st.sampled_from(PIECES), max_size=40)).map(
    lambda t: t[0] + b"".join(t[1])
)
value = st.lists(st.sampled_from([b"a", b" ", b":", b"1", b"\x00", b"\xc3\xa9", b"{}"]), max_size=4).map(b"".join)
names = st.sampled_from([b"data", b"event", b"id", b"retry", b"other", b""])
line = st.one_of(
    st.tuples(names, st.sampled_from([b":", b": ", b""]), value).map(b"".join),
    st.just(b""),  # a blank line inside the list: an extra empty block
)
eol = st.sampled_from([b"\n", b"\r\n", b"\r"])
blocks = st.lists(st.tuples(st.lists(st.tuples(line, eol), max_size=4), eol), max_size=6).map(
    lambda bs: b"".join(b"".join(text + end for text, end in lines) + end for lines, end in bs)
)
streams = st.one_of(raw_streams, st.tuples(blocks, st.sampled_from([b"", b"data: tail", b"data: x\r"])).map(b"".join))


@st.composite
def chunked(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    stream = draw(streams)
    cuts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    bounds = [0, *cuts, len(stream)]
    return stream, [stream[a:b] for a, b in itertools.pairwise(bounds)]


@FAST
@given(streams)
def test_whole_stream_matches_reference(stream: bytes) -> None:
    expected, tail = reference(stream)
    out = run([stream])
    assert out.fed == expected
    assert out.closed == []
    assert out.pending == len(tail)


@FAST
@given(chunked())
def test_any_chunking_matches_reference(case: tuple[bytes, list[bytes]]) -> None:
    stream, chunks = case
    expected, tail = reference(stream)
    out = run(chunks)
    assert canonical(stream, out) == (expected, len(tail))
    # The invariant the proxy relies on: the raws are exactly the input, minus BOM and partial event.
    whole = strip_bom(stream)
    assert b"".join(i.raw for i in out.fed + out.closed) == whole[: len(whole) - out.pending]
    assert out.closed in ([], [Event(b"\n")])


@st.composite
def with_status_block(draw: st.DrawFn) -> tuple[bytes, bytes, bool]:
    """Events, maybe a partial event, a status block (one line ending throughout), more events."""
    e = draw(eol)
    body = draw(st.sampled_from([b'{"error": "busy"}', b"x", b"a\r\n\r\nb\n\n"]))
    with_length = draw(st.booleans()) or b"\n" in body or b"\r" in body
    head = [draw(st.sampled_from([b"HTTP/1.1 503 Service Unavailable", b"HTTP/1.0 500"]))]
    head += draw(st.lists(st.sampled_from([b"Content-Type: application/json", b"Retry-After: 3"]), max_size=2))
    if with_length:
        head.append(b"Content-Length: %d" % len(body))
    block = b"".join(line + e for line in head) + e + body + (b"" if with_length else e + e)
    partial = draw(st.sampled_from([b"", b"data: partial" + e, b"event: x" + e + b"data:" + e]))
    stream = draw(blocks) + partial + block + draw(blocks)
    return stream, body, with_length


@FAST
@given(with_status_block(), st.data())
def test_status_block_at_any_chunking(case: tuple[bytes, bytes, bool], data: st.DataObject) -> None:
    stream, body, with_length = case
    whole = run([stream])
    (status,) = [i for i in whole.fed + whole.closed if isinstance(i, StatusBlock)]
    assert (status.raw.startswith(b"HTTP/1."), status.body) == (True, body)
    assert ("content-length" in status.headers) == with_length
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    chunks = [stream[a:b] for a, b in itertools.pairwise([0, *cuts, len(stream)])]
    assert canonical(stream, run(chunks)) == canonical(stream, whole)


def test_one_line_events_read_one_per_feed_are_those_events_and_leave_the_reader_idle() -> None:
    reader = SSEReader()
    assert reader.feed(b"data: a\n\n") == [Event(b"data: a\n\n", None, b"a", True)]  # (settles the BOM)
    for raw in (b'data: {"x":1}\n\n', b"data: \n\n", b"data: HTTP/1.1 200 OK\n\n"):
        assert reader.idle
        assert reader.feed(raw) == [Event(raw, None, raw[6:-2], True)]
    assert reader.idle
    assert reader.feed(b"data: a\ndata: b\n\n") == [Event(b"data: a\ndata: b\n\n", None, b"a\nb", True)]
    assert reader.feed(b"data: a\r\n\r\n") == [Event(b"data: a\r\n\r\n", None, b"a", True)]
    assert not reader.idle  # a CR was seen: the general search from here on
    assert reader.feed(b"data: b\n\n") == [Event(b"data: b\n\n", None, b"b", True)]
    small = SSEReader(16)
    small.feed(b"data: a\n\n")
    with pytest.raises(EventTooLarge):
        small.feed(b"data: " + b"x" * 20 + b"\n\n")  # (the bound holds for the quick read too)
