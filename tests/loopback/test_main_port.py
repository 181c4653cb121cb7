"""The main port's HTTP/1.1, spoken by hand: pipelining, chunked uploads, HTTP/1.0, HEAD, Expect.

The main port is the proxy's own asyncio protocol (llhttp parsing), so what aiohttp's server used to
guarantee is asserted here on the wire: pipelined requests are answered in order, each whole; a
chunked request body goes upstream whole; HTTP/1.0 gets a close unless it asked for keep-alive; a
HEAD answer carries no body; an unread body is read out before the close, so the client sees its 413.
"""

from __future__ import annotations

import asyncio
import base64

import orjson
from support import Proxy, ProxyFactory
from support.hostile import WAIT

CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


async def _read_response(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, str], bytes]:
    """One response off the wire: its status line, headers and body (by length, or chunked)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readline()).strip(), 16)
            if size == 0:
                await reader.readline()
                break
            body += await reader.readexactly(size)
            await reader.readline()
    else:
        body = await reader.read()
    return lines[0].encode(), headers, body


async def _connect(proxy: Proxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(proxy.host, proxy.port)


async def test_pipelined_requests_are_answered_in_order(proxy: Proxy) -> None:
    reader, writer = await _connect(proxy)
    try:
        writer.write(
            b"GET /_fake/echo/one HTTP/1.1\r\nHost: x\r\nX-Request-Id: p-1\r\n\r\n"
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: p-2\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            b"GET /_fake/echo/three HTTP/1.1\r\nHost: x\r\nX-Request-Id: p-3\r\n\r\n" % (len(CHAT), CHAT)
        )
        await writer.drain()
        async with asyncio.timeout(WAIT):
            answers = [await _read_response(reader) for _ in range(3)]
    finally:
        writer.close()
    assert [status for status, _, _ in answers] == [b"HTTP/1.1 200 OK"] * 3
    assert [headers["x-request-id"] for _, headers, _ in answers] == ["p-1", "p-2", "p-3"]
    assert orjson.loads(answers[0][2])["path"] == "/_fake/echo/one"
    assert orjson.loads(answers[1][2])["object"] == "chat.completion"
    assert orjson.loads(answers[2][2])["path"] == "/_fake/echo/three"
    lines = await proxy.settled()
    assert [(line["request_id"], line["outcome"]) for line in lines] == [("p-1", "ok"), ("p-2", "ok"), ("p-3", "ok")]


async def test_a_chunked_request_body_goes_upstream_whole(proxy: Proxy) -> None:
    body = b'{"model": "m", "input": "' + b"y" * 70_000 + b'"}'
    pieces = [body[i : i + 9_000] for i in range(0, len(body), 9_000)]
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"
    reader, writer = await _connect(proxy)
    try:
        writer.write(b"POST /_fake/echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked)
        await writer.drain()
        async with asyncio.timeout(WAIT):
            status, _, answer = await _read_response(reader)
    finally:
        writer.close()
    assert status == b"HTTP/1.1 200 OK"
    echoed = orjson.loads(answer)
    assert base64.b64decode(echoed["body"]) == body
    assert "transfer-encoding" not in {name.lower() for name in echoed["headers"]}
    assert echoed["headers"]["Content-Length"] == str(len(body))


async def test_http10_closes_unless_it_asked_for_keep_alive(proxy: Proxy) -> None:
    reader, writer = await _connect(proxy)
    try:
        writer.write(b"GET /_fake/echo HTTP/1.0\r\nHost: x\r\n\r\n")
        async with asyncio.timeout(WAIT):
            status, headers, _ = await _read_response(reader)
            assert await reader.read() == b""  # closed after the answer
    finally:
        writer.close()
    assert (status, headers["connection"]) == (b"HTTP/1.1 200 OK", "close")

    reader, writer = await _connect(proxy)
    try:
        for _ in range(2):  # the same connection, twice
            writer.write(b"GET /_fake/echo HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\n\r\n")
            async with asyncio.timeout(WAIT):
                status, headers, _ = await _read_response(reader)
            assert (status, headers["connection"]) == (b"HTTP/1.1 200 OK", "keep-alive")
    finally:
        writer.close()


async def test_a_head_answer_has_its_length_and_no_body(proxy: Proxy) -> None:
    reader, writer = await _connect(proxy)
    try:
        writer.write(b"HEAD /_fake/download?bytes=5000 HTTP/1.1\r\nHost: x\r\n\r\n"
                     b"GET /_fake/download?bytes=3 HTTP/1.1\r\nHost: x\r\n\r\n")  # fmt: skip
        async with asyncio.timeout(WAIT):
            head = await reader.readuntil(b"\r\n\r\n")
            status, _headers, body = await _read_response(reader)  # the next answer starts right after
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 200")
    assert b"Content-Length: 5000\r\n" in head
    assert (status, body) == (b"HTTP/1.1 200 OK", bytes([0, 1, 2]))


async def test_a_body_too_large_is_refused_and_read_out_before_the_close(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(max_body_size=1000)
    reader, writer = await _connect(proxy)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"%x\r\n%s\r\n" % (3000, b"z" * 3000))  # past the limit; the client sends on
        await writer.drain()
        async with asyncio.timeout(WAIT):
            status, headers, body = await _read_response(reader)
            writer.write(b"0\r\n\r\n")  # the rest of its body: read and discarded, then the close
            await writer.drain()
            assert await reader.read() == b""
    finally:
        writer.close()
    assert (status, headers["connection"]) == (b"HTTP/1.1 413 Request Entity Too Large", "close")
    assert orjson.loads(body)["error"]["code"] == "body_too_large"
