"""The bench's floor (`proxy.tools.bench.floor`) over raw sockets: the fake's own bytes, keep-alive on both
sides, a departed client's upstream closed, a dead upstream a 502."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import orjson
import pytest
from support.ports import free_port

from proxy.tools.bench.client import ResponseReader
from proxy.tools.bench.floor import start as start_floor
from proxy.tools.fake.fast import start as start_fake

STREAM = {"model": "fast", "stream": True, "max_tokens": 20, "stream_options": {"include_usage": True},
          "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
WHOLE = {**STREAM, "stream": False}


def _request(body: object, headers: str = "") -> bytes:
    data = orjson.dumps(body)
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n{headers}\r\n"
            ).encode() + data  # fmt: skip


def _steady(raw: bytes) -> bytes:
    """The answer without its clock (the fake stamps `created` in seconds)."""
    return re.sub(rb'"created":\d+', b'"created":0', raw)


async def _answer(reader: asyncio.StreamReader) -> bytes:
    """One whole answer's raw bytes (chunked or Content-Length), nothing after it."""
    parsed, raw = ResponseReader(0.0), b""
    async with asyncio.timeout(10):
        while not parsed.exchange.done:
            data = await reader.read(65536)
            assert data, "the connection closed mid-answer"
            raw += data
            assert parsed.feed(data, 1.0) == b""
    return raw


@pytest.fixture
async def fake() -> AsyncIterator[int]:
    server, port = await start_fake("127.0.0.1", 0)
    async with server:
        yield port


@pytest.fixture
async def floor(fake: int) -> AsyncIterator[int]:
    server, port, pool = await start_floor("127.0.0.1", 0, "127.0.0.1", fake)
    async with server:
        yield port
        pool.close()


async def _both(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        return await _answer(reader)
    finally:
        writer.close()


@pytest.mark.parametrize("body", [WHOLE, STREAM], ids=["whole (Content-Length)", "stream (chunked)"])
async def test_an_answer_through_the_floor_is_the_fakes_own_bytes(fake: int, floor: int, body: object) -> None:
    direct = await _both(fake, _request(body))
    through = await _both(floor, _request(body))
    assert _steady(through) == _steady(direct)
    assert (b"Transfer-Encoding: chunked" in through) is (body is STREAM)


async def test_keep_alive_on_both_sides_and_pipelined_requests_in_order(fake: int) -> None:
    """Three requests on one client connection (two pipelined) use one upstream connection, which a
    raw TCP relay between the floor and the fake counts."""
    opened: list[asyncio.StreamWriter] = []
    ended = asyncio.Event()

    async def relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        opened.append(client_w)
        up_r, up_w = await asyncio.open_connection("127.0.0.1", fake)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                dst.write(data)
            dst.close()

        try:
            await asyncio.gather(pipe(client_r, up_w), pipe(up_r, client_w))
        finally:
            ended.set()

    counter = await asyncio.start_server(relay, "127.0.0.1", 0)
    async with counter:
        server, port, pool = await start_floor("127.0.0.1", 0, "127.0.0.1", counter.sockets[0].getsockname()[1])
        async with server:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_request({**WHOLE, "max_tokens": 1}))
            first = await _answer(reader)
            writer.write(_request(STREAM) + _request({**WHOLE, "max_tokens": 2}))
            second, third = await _answer(reader), await _answer(reader)
            writer.close()
            pool.close()
        async with asyncio.timeout(10):
            await ended.wait()  # the floor closed its idle connection: the relay's pipes ended
    assert b"token " in first
    assert second.count(b"data: ") == 24  # role, 20 tokens, finish, usage, [DONE]
    assert orjson.loads(third.split(b"\r\n\r\n", 1)[1])["choices"][0]["message"]["content"] == "token token "
    assert len(opened) == 1


async def test_a_client_that_leaves_mid_stream_closes_its_upstream_connection(fake: int, floor: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", floor)
    slow = {**STREAM, "model": "fast-50ms", "max_tokens": 100}
    writer.write(_request(slow, "X-Request-Id: gone\r\nx-fast-record: 1\r\n"))
    async with asyncio.timeout(10):
        await reader.readuntil(b"\n\n")
    writer.close()
    probe_r, probe_w = await asyncio.open_connection("127.0.0.1", fake)
    closed: dict[str, float] = {}
    async with asyncio.timeout(10):
        while "gone" not in closed:
            probe_w.write(b"GET /_fast/closes HTTP/1.1\r\nHost: x\r\n\r\n")
            closed = orjson.loads((await _answer(probe_r)).split(b"\r\n\r\n", 1)[1])["closed"]
            await asyncio.sleep(0.01)
    probe_w.close()


async def test_an_upstream_that_is_not_there_is_a_502_and_a_close() -> None:
    server, port, _ = await start_floor("127.0.0.1", 0, "127.0.0.1", free_port())
    async with server:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_request(WHOLE))
        async with asyncio.timeout(10):
            raw = await reader.read()  # until the floor closes
        writer.close()
    assert raw == b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


async def test_a_head_answer_ends_with_its_head_and_the_connection_is_reused() -> None:
    """An upstream's answer to HEAD announces a body it does not send: the next request still gets its own."""
    seen: list[bytes] = []

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readuntil(b"\r\n\r\n"):
            seen.append(line.split(b" ", 1)[0])
            body = b"" if line.startswith(b"HEAD") else b"hello"
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n" + body)
            if len(seen) == 2:
                break
        writer.close()

    backend = await asyncio.start_server(upstream, "127.0.0.1", 0)
    async with backend:
        server, port, pool = await start_floor("127.0.0.1", 0, "127.0.0.1", backend.sockets[0].getsockname()[1])
        async with server:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            async with asyncio.timeout(10):
                raw = await reader.read()  # the second asked for a close
            writer.close()
            pool.close()
    assert raw == b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n" * 2 + b"hello"
    assert seen == [b"HEAD", b"GET"]


async def test_an_interim_answer_is_relayed_and_the_final_one_ends_the_exchange() -> None:
    ended = asyncio.Event()

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await reader.readexactly(2)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await reader.read()  # until the floor closes its idle connection
            writer.close()
        finally:
            ended.set()

    backend = await asyncio.start_server(upstream, "127.0.0.1", 0)
    async with backend:
        server, port, pool = await start_floor("127.0.0.1", 0, "127.0.0.1", backend.sockets[0].getsockname()[1])
        async with server:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
            async with asyncio.timeout(10):
                assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
                writer.write(b"hi")
                assert await _answer(reader) == b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
            assert len(pool.idle) == 1  # the final answer returned the connection to the pool
            writer.close()
            pool.close()
        async with asyncio.timeout(10):
            await ended.wait()  # the floor closed its idle connection: the backend's read ended


async def test_a_chunked_request_body_reaches_the_upstream_chunked() -> None:
    """llhttp hands the floor a chunked body's data: it frames each piece again, and ends the body."""
    got: list[bytes] = []

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got.append(await reader.readuntil(b"\r\n\r\n"))
        got.append(await reader.readuntil(b"0\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        writer.close()

    backend = await asyncio.start_server(upstream, "127.0.0.1", 0)
    async with backend:
        server, port, pool = await start_floor("127.0.0.1", 0, "127.0.0.1", backend.sockets[0].getsockname()[1])
        async with server:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
            writer.write(b"1;ext=1\r\n!\r\n0\r\nTrailer-Field: x\r\n\r\n")
            async with asyncio.timeout(10):
                assert await _answer(reader) == b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
            writer.close()
            pool.close()
    assert b"Transfer-Encoding: chunked\r\n" in got[0]
    framed, data = got[1], b""
    while not framed.startswith(b"0\r\n"):  # (the pieces as the reads split them)
        size, _, framed = framed.partition(b"\r\n")
        data, framed = data + framed[: int(size, 16)], framed[int(size, 16) + 2 :]
    assert (data, framed) == (b"hello!", b"0\r\n\r\n")
