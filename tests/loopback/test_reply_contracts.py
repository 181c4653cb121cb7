"""The shell carries out the lifecycle's `Reply`: one contract per value, on the wire and in the books.

A real proxy on loopback, a raw-socket upstream where it must misbehave, raw-socket clients so that
every byte the client receives is seen: the status line and headers, the body's framing, the close.

- STATUS: a whole error response in the dialect's shape, the same `X-Request-Id` as its log line;
  connection-level refusals (no request at all: too many connections, a head llhttp rejects, too
  large, a method or version nginx refuses, a head that does not arrive in time) are the same
  lifecycle verdict, booked by the same code, and so are the handler's own.
- FRAME: a committed stream that breaks ends with the dialect's error frame and the body's proper end.
- CUT: a committed plain body that breaks is cut: fewer bytes than announced, then the close.
- NOTHING: an answer that ended normally gets no byte more (the next response on the connection
  follows it exactly); a client that left gets nothing, and its upstream is cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from support import Proxy, ProxyFactory
from support.hostile import WAIT, Connection, RawUpstream

CHAT_STREAM = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
EVENT = (b'data: {"id":"c1","object":"chat.completion.chunk","model":"m",'
         b'"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n')
STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
FIRST_CHUNK = b"%x\r\n%b\r\n" % (len(EVENT), EVENT)
PLAIN_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: 100\r\n\r\n"


async def _talk(port: int, data: bytes) -> bytes:
    """Send `data` on a new connection, read everything until the proxy closes it (or cuts it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    received = bytearray()
    try:
        writer.write(data)
        async with asyncio.timeout(WAIT):
            while True:
                try:
                    piece = await reader.read(65536)
                except ConnectionResetError:
                    break
                if not piece:
                    break
                received += piece
    finally:
        writer.close()
    return bytes(received)


def _split(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        assert name.lower() not in headers, f"{name} twice"
        headers[name.lower()] = value.strip()
    return int(lines[0].split(" ")[1]), headers, body


def _dechunk(body: bytes) -> tuple[bytes, bool]:
    """The chunked body's data, and whether it ended with the last chunk."""
    data = bytearray()
    while body:
        size_line, sep, rest = body.partition(b"\r\n")
        if not sep:
            return bytes(data), False
        size = int(size_line, 16)
        if size == 0:
            return bytes(data), rest == b"\r\n"
        data += rest[:size]
        body = rest[size + 2 :]
    return bytes(data), False


def _requests(proxy: Proxy, api: str, outcome: str, reason: str) -> float:
    return proxy.sample("streamwarden_requests_total", {"api": api, "model": "unknown", "outcome": outcome,
                                                       "reason": reason})


async def _booked(proxy: Proxy, request_id: str) -> dict[str, Any]:
    return await proxy.line_for(request_id)


# ---- STATUS ---------------------------------------------------------------------------------------


async def _hold_one_connection(proxy: Proxy) -> Callable[[], None]:
    """Take the only connection --max-client-connections 1 allows; returns its close."""
    _reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    main = proxy.server.main_server
    assert main is not None
    async with asyncio.timeout(WAIT):
        while main.open_connections < 1:  # noqa: ASYNC110 - the accept is announced by nothing else
            await asyncio.sleep(0.01)
    return writer.close


REFUSALS = {
    # name: (what the client sends, proxy options, status, reason)
    "parser-reject": (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n", {}, 400, "bad_request"),
    "head-too-large": (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 2048 + b"\r\n\r\n",
                       {"max_header_size": 1024}, 431, "bad_request"),
    "trace": (b"TRACE / HTTP/1.1\r\nHost: x\r\n\r\n", {}, 405, "bad_request"),
    "http2-line": (b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", {}, 505, "bad_request"),
    "header-timeout": (b"GET / HTTP/1.1\r\nHost: x\r\n", {"client_header_timeout": 0.2}, 408, "client_timeout"),
    "too-many-connections": (b"", {"max_client_connections": 1}, 503, "proxy_overloaded"),
}


@pytest.mark.parametrize("case", list(REFUSALS), ids=list(REFUSALS))
async def test_status_a_connection_level_refusal_is_a_lifecycle_verdict_booked_once(
    make_proxy: ProxyFactory, case: str
) -> None:
    sent, options, status, reason = REFUSALS[case]
    proxy = await make_proxy(**options)
    release = await _hold_one_connection(proxy) if case == "too-many-connections" else None
    try:
        raw = await _talk(proxy.port, sent)
    finally:
        if release is not None:
            release()
    got, headers, body = _split(raw)
    assert got == status
    assert headers["connection"] == "close"
    assert headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body)  # and then the close: nothing after it
    assert orjson.loads(body)["error"]["code"] == reason
    assert ("retry-after" in headers) is (status == 503)
    line = await _booked(proxy, headers["x-request-id"])  # the id the client got is the one booked
    assert (line["outcome"], line["reason"], line["status"], line["bytes_out"]) == ("error", reason, status, len(body))
    assert _requests(proxy, "other", "error", reason) == 1
    assert proxy.sample("streamwarden_inflight_requests", {"api": "other"}) == 0


async def test_status_a_handler_refusal_in_the_dialects_shape_closes_as_it_says(make_proxy: ProxyFactory) -> None:
    """A request the handler refuses (a path that climbs above the root, its body read whole) gets its
    400 with `Connection: close`, and the connection then closes, as the head promised."""
    proxy = await make_proxy()
    raw = await _talk(proxy.port, b"GET /v1/../../etc/passwd HTTP/1.1\r\nHost: x\r\nX-Request-Id: climb\r\n\r\n")
    got, headers, body = _split(raw)
    assert (got, headers["connection"], headers["x-request-id"]) == (400, "close", "climb")
    assert orjson.loads(body)["error"]["code"] == "bad_request"
    line = await _booked(proxy, "climb")
    assert (line["outcome"], line["reason"], line["status"]) == ("error", "bad_request", 400)


# ---- FRAME ----------------------------------------------------------------------------------------


async def test_frame_a_committed_stream_that_breaks_ends_with_the_error_frame(make_proxy: ProxyFactory) -> None:
    async def script(connection: Connection) -> None:
        await connection.next_request()
        await connection.send(STREAM_HEAD + FIRST_CHUNK)
        connection.writer.transport.abort()  # cut mid-stream, without the last chunk

    upstream = RawUpstream(script)
    proxy = await make_proxy(upstream=await upstream.start(), hold_headers=0)
    try:
        raw = await _talk(proxy.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: frame\r\n"
                          b"Connection: close\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                          % (len(CHAT_STREAM), CHAT_STREAM))
    finally:
        await upstream.close()
    got, headers, body = _split(raw)
    assert (got, headers["x-request-id"], headers["transfer-encoding"]) == (200, "frame", "chunked")
    data, ended = _dechunk(body)
    assert ended  # the body's proper end after the frame: the SDKs raise on the frame, not on a broken body
    assert data.startswith(EVENT)
    frame = orjson.loads(data[len(EVENT) :].removeprefix(b"data: ").split(b"\n\n")[0])
    assert frame["error"]["code"] == "stream_cut"
    line = await _booked(proxy, "frame")
    assert (line["outcome"], line["reason"], line["status"], line["stream"]) == ("error", "stream_cut", 200, True)
    assert line["bytes_out"] == len(data)


# ---- CUT ------------------------------------------------------------------------------------------


async def test_cut_a_committed_plain_body_that_breaks_is_cut(make_proxy: ProxyFactory) -> None:
    async def script(connection: Connection) -> None:
        await connection.next_request()
        await connection.send(PLAIN_HEAD + b"x" * 50)
        connection.writer.transport.abort()  # half the body, then the cut

    upstream = RawUpstream(script)
    proxy = await make_proxy(upstream=await upstream.start())
    try:
        raw = await _talk(proxy.port, b"GET /files/big HTTP/1.1\r\nHost: x\r\nX-Request-Id: cut\r\n\r\n")
    finally:
        await upstream.close()
    got, headers, body = _split(raw)
    assert (got, headers["x-request-id"], headers["content-length"]) == (200, "cut", "100")
    assert body == b"x" * 50  # no second response, no error JSON in the body: the close says it broke
    line = await _booked(proxy, "cut")
    assert (line["outcome"], line["status"], line["bytes_out"]) == ("error", 200, 50)
    assert line["reason"] == "stream_cut"


# ---- NOTHING --------------------------------------------------------------------------------------


async def test_nothing_after_a_complete_answer_the_next_one_follows_it_exactly(make_proxy: ProxyFactory) -> None:
    async def script(connection: Connection) -> None:
        while await connection.next_request() is not None:
            await connection.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nhello")

    upstream = RawUpstream(script)
    proxy = await make_proxy(upstream=await upstream.start())
    try:
        raw = await _talk(proxy.port, b"GET /a HTTP/1.1\r\nHost: x\r\nX-Request-Id: n1\r\n\r\n"
                          b"GET /b HTTP/1.1\r\nHost: x\r\nX-Request-Id: n2\r\nConnection: close\r\n\r\n")
    finally:
        await upstream.close()
    first, _, rest = raw.partition(b"\r\n\r\nhello")
    assert _split(first + b"\r\n\r\n")[1]["x-request-id"] == "n1"
    got, headers, body = _split(rest)
    assert (got, headers["x-request-id"], body) == (200, "n2", b"hello")  # not a byte between the two
    for rid in ("n1", "n2"):
        line = await _booked(proxy, rid)
        assert (line["outcome"], line["reason"], line["status"], line["bytes_out"]) == ("ok", "complete", 200, 5)


async def test_nothing_a_client_that_left_mid_stream_is_aborted_and_its_upstream_cancelled(
    make_proxy: ProxyFactory,
) -> None:
    closed_by_proxy = asyncio.Event()

    async def script(connection: Connection) -> None:
        await connection.next_request()
        await connection.send(STREAM_HEAD + FIRST_CHUNK)
        await connection.wait_closed_by_peer()
        closed_by_proxy.set()

    upstream = RawUpstream(script)
    proxy = await make_proxy(upstream=await upstream.start(), hold_headers=0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: left\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%b" % (len(CHAT_STREAM), CHAT_STREAM))
        async with asyncio.timeout(WAIT):
            await reader.readuntil(EVENT + b"\r\n")  # the first event arrived: the client leaves
        writer.close()
        async with asyncio.timeout(WAIT):
            await closed_by_proxy.wait()
    finally:
        await upstream.close()
    line = await _booked(proxy, "left")
    assert (line["outcome"], line["reason"], line["abort_phase"]) == ("aborted", "client_disconnect", "mid_stream")
    assert line["upstream_cancelled"] is True
    assert proxy.sample("streamwarden_upstream_cancellations_total",
                        {"api": line["api"], "reason": "client_disconnect"}) == 1
