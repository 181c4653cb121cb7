"""The main port's strictness and bounds on the wire.

Pipelined requests are parsed one at a time, at most MAX_PARSED_AHEAD behind the one in progress;
a body llhttp rejects after its head is answered at once (400, or 501 for an unknown transfer
coding) with `--client-body-timeout` far above the test's wait, so only a wait for the timeout could
fail it; heads nginx refuses are refused as nginx does, a pipelined one in its turn.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest
from support import Proxy, ProxyFactory, until
from support.hostile import WAIT

from proxy.core.http_head import MAX_HEADERS
from proxy.server.connections import MAX_PARSED_AHEAD, ClientConnection, State

GET = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
CLOSE = b"Connection: close\r\n"
CLOSE_GET = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(lines[0].split()[1]), headers, body


async def _answers(proxy: Proxy, data: bytes, count: int) -> list[int]:
    """Send `data`, read `count` answers, then the close; their statuses."""
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(WAIT):
            statuses = [(await _read_response(reader))[0] for _ in range(count)]
            assert await reader.read() == b""  # then the close
    finally:
        writer.close()
    return statuses


@pytest.fixture
async def patient(make_proxy: ProxyFactory) -> Proxy:
    """A body timeout no test waits for: an answer that waited for it fails the test's own bound."""
    return await make_proxy(client_body_timeout=3600.0)


def _connection(proxy: Proxy) -> ClientConnection:
    assert proxy.server.main_server is not None
    (connection,) = proxy.server.main_server.connections
    return connection


# ---- item 1: what one connection parses ahead is bounded -------------------------------------------


async def test_pipelined_requests_are_parsed_ahead_only_within_the_bound(proxy: Proxy) -> None:
    count = 3000  # ~100 KiB of heads: a read or two, every request parsed at once before the bound
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    try:
        writer.write(GET * count)
        await writer.drain()
        async with asyncio.timeout(WAIT * 3):
            for _ in range(count):  # read slowly: one answer at a time, as the proxy writes them
                status, _, body = await _read_response(reader)
                assert status == 200, body
                connection = _connection(proxy)
                assert connection.parsed_ahead <= MAX_PARSED_AHEAD
                assert connection.held_bytes <= len(GET) * count
    finally:
        writer.close()
    assert connection.peak_parsed_ahead <= MAX_PARSED_AHEAD


async def test_pipelined_bodies_and_chunks_are_parsed_in_their_turn(proxy: Proxy) -> None:
    chat = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    sized = b"POST /_fake/echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(chat), chat)
    chunked = (b"POST /_fake/echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"3;ext=1\r\n\r\n\r\r\n0\r\nX-Trailer: 1\r\n\r\n")  # fmt: skip
    data = (sized + chunked + GET) * 20
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(WAIT):
            bodies = [(await _read_response(reader)) for _ in range(60)]
    finally:
        writer.close()
    assert [status for status, _, _ in bodies] == [200] * 60
    assert _connection(proxy).peak_parsed_ahead <= MAX_PARSED_AHEAD


_ECHO = b"POST /_fake/echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    "chunked",
    [
        pytest.param(_ECHO + b"2;e=" + b"a" * 5000 + b"\r\n{}\r\n0\r\n\r\n", id="5k-extension"),
        pytest.param(_ECHO + b"0" * 5000 + b"2\r\n{}\r\n0\r\n\r\n", id="5k-leading-zeros"),
        pytest.param(_ECHO + b"2\r\n{}\r\n0\r\nT: " + b"a" * 5000 + b"\r\n\r\n", id="5k-trailer"),
    ],
)
async def test_long_chunk_lines_do_not_let_pipelined_requests_be_parsed_at_once(proxy: Proxy, chunked: bytes) -> None:
    """llhttp accepts these lines (nginx too); the cutter once gave up past 4,096 bytes and fed the whole
    read, so every request behind it was parsed at once (one client: 682,000 queued, 729 MiB)."""
    count = 300  # ~11 KB of pipelined heads in the same write
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    try:
        writer.write(chunked + GET * count)
        await writer.drain()
        async with asyncio.timeout(WAIT * 3):
            statuses = [(await _read_response(reader))[0] for _ in range(count + 1)]
    finally:
        writer.close()
    assert statuses == [200] * (count + 1)
    assert _connection(proxy).peak_parsed_ahead <= MAX_PARSED_AHEAD


# ---- item 5: a body llhttp rejects is answered at once ---------------------------------------------

POST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


@pytest.mark.parametrize(
    ("data", "status"),
    [
        pytest.param(POST + b"Transfer-Encoding: gzip\r\n\r\nabc", 501, id="transfer-encoding-gzip"),
        pytest.param(POST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n", 400, id="bad-chunk-size"),
        pytest.param(POST + b"Transfer-Encoding: chunked\r\n\r\n3\nabc\r\n0\r\n\r\n", 400, id="bare-lf-chunk-line"),
        pytest.param(POST + b"Transfer-Encoding: chunked\r\n\r\n3\r\nabcdef\r\n0\r\n\r\n", 400, id="chunk-too-long"),
    ],
)
async def test_a_body_the_parser_rejects_is_answered_at_once(patient: Proxy, data: bytes, status: int) -> None:
    reader, writer = await asyncio.open_connection(patient.host, patient.port)
    try:
        writer.write(data)  # and nothing more: the client waits for its answer
        await writer.drain()
        async with asyncio.timeout(WAIT):
            answered, headers, body = await _read_response(reader)
    finally:
        writer.close()
    assert (answered, headers["connection"]) == (status, "close")
    assert orjson.loads(body)["error"]["code"] == "bad_request"
    await until(lambda: bool(patient.log_lines()))
    lines = patient.log_lines()
    assert len(lines) == 1, lines
    (line,) = lines
    assert (line["status"], line["outcome"], line["reason"]) == (status, "error", "bad_request")


async def test_after_a_body_the_parser_rejects_the_connection_closes_without_lingering(patient: Proxy) -> None:
    """nginx closes at once; the proxy read and discarded for LINGERING_SECONDS (5 s), though nothing
    after a rejected chunk line can be framed. The state says which: a lingering close is LINGERING."""
    reader, writer = await asyncio.open_connection(patient.host, patient.port)
    try:
        writer.write(POST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n")
        await writer.drain()
        await until(lambda: bool(patient.server.main_server and patient.server.main_server.connections))
        connection = _connection(patient)
        async with asyncio.timeout(WAIT):
            assert (await _read_response(reader))[0] == 400
            await until(lambda: connection.state in (State.LINGERING, State.CLOSED))
            assert connection.state is State.CLOSED
            assert await reader.read() == b""
    finally:
        writer.close()


@pytest.mark.parametrize("space", [b" ", b"\t", b" \t "])
async def test_a_content_length_with_trailing_whitespace_keeps_the_early_413(proxy: Proxy, space: bytes) -> None:
    """llhttp takes `Content-Length: N ` as N: so must the bound, before the 100 Continue (the proxy
    answered 100 and read 64 MiB first; nginx answers 413 at once)."""
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    try:
        writer.write(POST + b"Expect: 100-continue\r\nContent-Length: 100000000" + space + b"\r\n\r\n")
        await writer.drain()
        async with asyncio.timeout(WAIT):
            status, headers, _ = await _read_response(reader)
    finally:
        writer.close()
    assert (status, headers["connection"]) == (413, "close")


async def test_a_content_length_with_trailing_whitespace_frames_the_body(proxy: Proxy) -> None:
    chat = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    sized = b"POST /_fake/echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d \r\n\r\n%s" % (len(chat), chat)
    assert await _answers(proxy, (sized + GET) * 3 + CLOSE_GET, 7) == [200] * 7


@pytest.mark.parametrize(("count", "status"), [(MAX_HEADERS, 200), (MAX_HEADERS + 1, 431), (10_000, 431)])
async def test_header_fields_are_bounded_in_number(proxy: Proxy, count: int, status: int) -> None:
    """10,000 `a:b` fields (50 KB, within --max-header-size) were all forwarded; nginx answers 400."""
    fields = b"Host: x\r\nConnection: close\r\n" + b"a:b\r\n" * (count - 2)
    assert await _answers(proxy, b"GET /v1/models HTTP/1.1\r\n" + fields + b"\r\n", 1) == [status]
    if status == 431:
        await until(lambda: bool(proxy.log_lines()))
        assert [(line["status"], line["reason"]) for line in proxy.log_lines()] == [(431, "bad_request")]


# ---- item 6: heads nginx refuses -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "statuses"),
    [
        pytest.param(GET + b"TRACE /v1/models HTTP/1.1\r\nHost: x\r\n\r\n" + GET, [200, 405], id="trace-pipelined"),
        pytest.param(GET + b"GET /v1/models HTTP/2.0\r\nHost: x\r\n\r\n" + GET, [200, 505], id="http2-pipelined"),
        pytest.param(b"TRACE  /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", [405], id="trace-two-spaces"),
        pytest.param(b"GET  /v1/models  HTTP/2.0\r\nHost: x\r\n\r\n", [505], id="http2-two-spaces"),
        pytest.param(b"GET /v1/models HTTP/1.1\r\n\r\n", [400], id="http11-without-host"),
        pytest.param(GET + b"GET /v1/models HTTP/1.1\r\n\r\n", [200, 400], id="pipelined-without-host"),
        pytest.param(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", [400], id="two-hosts"),
        pytest.param(b"GET http://u:p@x/v1/models HTTP/1.1\r\nHost: x\r\n\r\n", [400], id="absolute-form-userinfo"),
        pytest.param(POST + b"Expect: 100-continue\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n{}", [400],
                     id="expect-twice"),
    ],
)
async def test_heads_nginx_refuses_are_refused(proxy: Proxy, data: bytes, statuses: list[int]) -> None:
    assert await _answers(proxy, data, len(statuses)) == statuses
    await until(lambda: len(proxy.log_lines()) == len(statuses))
    assert [line["reason"] for line in proxy.log_lines()][len(statuses) - 1 :] == ["bad_request"]


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"GET  /v1/models  HTTP/1.1\r\nHost: x\r\n" + CLOSE + b"\r\n", id="two-spaces"),  # nginx too
        pytest.param(b"GET /v1/models HTTP/1.0\r\n\r\n", id="http10-without-host"),
        pytest.param(b"GET http://x/v1/models HTTP/1.1\r\nHost: x\r\n" + CLOSE + b"\r\n", id="absolute-form"),
    ],
)
async def test_heads_nginx_serves_are_served(proxy: Proxy, data: bytes) -> None:
    assert await _answers(proxy, data, 1) == [200]
