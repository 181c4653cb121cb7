"""The fake upstream's fast mode (`proxy.tools.fake.fast`) over raw sockets: what `streamwarden bench` relies on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest

from proxy.tools.bench.client import ResponseReader
from proxy.tools.fake.fast import _delay, start

STREAM = {"model": "fast", "stream": True, "max_tokens": 100, "stream_options": {"include_usage": True}}


@pytest.fixture
async def port() -> AsyncIterator[int]:
    server, bound = await start("127.0.0.1", 0)
    async with server:
        yield bound


def _request(body: object, headers: str = "", path: str = "/v1/chat/completions", method: str = "POST") -> bytes:
    data = orjson.dumps(body) if body is not None else b""
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n{headers}\r\n").encode() + data


async def _read_response(reader: asyncio.StreamReader) -> tuple[ResponseReader, bytes]:
    """One response, and its raw bytes."""
    parsed = ResponseReader(0.0)
    raw = b""
    async with asyncio.timeout(10):
        while not parsed.exchange.done:
            data = await reader.read(65536)
            assert data, "the fake closed the connection early"
            raw += data
            assert parsed.feed(data, 1.0) == b""
    return parsed, raw


async def test_a_stream_is_104_events_each_in_its_own_chunk(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_request(STREAM))
    parsed, raw = await _read_response(reader)
    assert parsed.exchange.status == 200
    assert parsed.exchange.events == 104  # role, 100 content chunks, finish, usage, [DONE]
    body = raw.split(b"\r\n\r\n", 1)[1]
    chunks = body.split(b"\r\n")[1::2][:-1]  # the data of each chunk (size lines are the even items)
    assert len(chunks) == 104
    assert all(chunk.count(b"\n\n") == 1 and chunk.endswith(b"\n\n") for chunk in chunks)
    assert 150 <= len(chunks[1]) <= 250  # a chat chunk of about 200 bytes
    assert chunks[-1] == b"data: [DONE]\n\n"
    assert b'"usage"' in chunks[-2]
    writer.write(_request({**STREAM, "stream": False, "max_tokens": 3}))  # keep-alive: the same connection
    whole, raw = await _read_response(reader)
    message = orjson.loads(raw.split(b"\r\n\r\n", 1)[1])["choices"][0]["message"]
    assert (whole.exchange.status, message["content"]) == (200, "token token token ")
    writer.close()


async def test_abandoned_and_ended_streams_are_noted(port: int) -> None:
    left_r, left_w = await asyncio.open_connection("127.0.0.1", port)
    left_w.write(_request({**STREAM, "model": "fast-50ms"}, "X-Request-Id: gone\r\nx-fast-record: 1\r\n"))
    async with asyncio.timeout(10):
        await left_r.readuntil(b"\n\n")
    left_w.close()
    done_r, done_w = await asyncio.open_connection("127.0.0.1", port)
    done_w.write(_request({**STREAM, "max_tokens": 2}, "X-Request-Id: whole\r\nx-fast-record: 1\r\n"))
    await _read_response(done_r)
    done_w.write(_request({**STREAM, "max_tokens": 2}, "X-Request-Id: unrecorded\r\n"))
    await _read_response(done_r)
    closes: dict[str, object] = {}
    async with asyncio.timeout(10):
        while "gone" not in closes.get("closed", {}):  # type: ignore[operator]
            done_w.write(_request(None, path="/_fast/closes", method="GET"))
            _, raw = await _read_response(done_r)
            closes = orjson.loads(raw.split(b"\r\n\r\n", 1)[1])
            await asyncio.sleep(0.01)
    assert list(closes["closed"]) == ["gone"]  # type: ignore[call-overload]
    assert closes["ended"] == ["whole"]
    done_w.close()


@pytest.mark.parametrize(
    ("request_bytes", "status", "message"),
    [
        (b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 3\r\n\r\n{x}", 400, b"not valid JSON"),
        (_request({"stream": True, "max_tokens": 0}), 400, b"max_tokens must be an integer"),
        (_request(None, path="/v1/embeddings"), 404, b"serves POST /v1/chat/completions"),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, b"Content-Length body"),
    ],
)
async def test_what_it_cannot_serve_is_a_clear_error_and_a_close(
    port: int, request_bytes: bytes, status: int, message: bytes
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request_bytes)
    async with asyncio.timeout(10):
        raw = await reader.read()  # until the fake closes
    assert raw.startswith(b"HTTP/1.1 %d " % status)
    assert b"Connection: close" in raw
    assert message in raw
    writer.close()


@pytest.mark.parametrize(("model", "seconds"), [("fast-20ms", 0.02), ("fast", 0.0), ("x-0ms", 0.0), ("m-5msx", 0.0)])
def test_the_model_name_sets_the_pace(model: str, seconds: float) -> None:
    assert _delay(model) == seconds
