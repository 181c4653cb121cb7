"""A whole answer carried in the connections' callbacks: no task where nothing waits.

The second request on a keep-alive client connection goes upstream on the idle connection the
first one left (`proxy.exchange.handler`: `_quick_link`), its head heard from the upstream
connection's callbacks. These tests hold that exchange at each of its waits (the head, a body still
arriving, a stream) and end it each way it can end there, to see the same verdicts, replies and
books as an exchange run as a task gives.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import orjson
from support import Proxy, ProxyFactory, until
from support.hostile import WAIT, Connection, RawUpstream, chat_json, response

from proxy.server.connections import ClientConnection

# The first-byte timeout of the test that waits it out: its warm-up request must beat it on a busy
# machine too (the timeout also bounds the warm-up's head), so not a fraction of a second.
_FIRST_BYTE = 2.0
_BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def _request(request_id: str) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"X-Request-Id: %s\r\nContent-Length: %d\r\n\r\n%s" % (request_id.encode(), len(_BODY), _BODY))  # fmt: skip


async def _response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            body += (await reader.readexactly(size + 2))[:size]
            if size == 0:
                return int(lines[0].split()[1]), headers, body
    return int(lines[0].split()[1]), headers, await reader.readexactly(int(headers.get("content-length", "0")))


Second = Callable[[Connection], Awaitable[None]]


async def _warmed(
    make_proxy: ProxyFactory, started: list[RawUpstream], second: Second, **flags: object
) -> tuple[Proxy, RawUpstream, asyncio.StreamReader, asyncio.StreamWriter]:
    """A proxy whose upstream answers a first request whole, then runs `second` on the same
    connection; a client connection that had its first answer."""

    async def script(connection: Connection) -> None:
        if await connection.next_request() is None:
            return
        await connection.send(response(200, chat_json("first")))
        if await connection.next_request() is None:
            return
        await second(connection)

    upstream = RawUpstream(script)
    started.append(upstream)
    proxy = await make_proxy(upstream=await upstream.start(), **flags)
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    writer.write(_request("warm"))
    async with asyncio.timeout(WAIT):
        status, _, _ = await _response(reader)
    assert status == 200
    return proxy, upstream, reader, writer


def _client_connection(proxy: Proxy) -> ClientConnection:
    assert proxy.server.main_server is not None
    (connection,) = proxy.server.main_server.connections
    return connection


async def test_the_wait_for_the_head_holds_no_task(
    make_proxy: ProxyFactory, raw_upstreams: list[RawUpstream]
) -> None:
    asked, answer = asyncio.Event(), asyncio.Event()

    async def second(connection: Connection) -> None:
        asked.set()
        await answer.wait()
        await connection.send(response(200, chat_json("second")))

    proxy, upstream, reader, writer = await _warmed(make_proxy, raw_upstreams, second)
    try:
        writer.write(_request("second"))
        async with asyncio.timeout(WAIT):
            await asked.wait()
            assert _client_connection(proxy).task is None  # the exchange waits in callbacks, not in a task
            answer.set()
            status, headers, body = await _response(reader)
        assert status == 200
        assert headers["x-request-id"] == "second"
        assert orjson.loads(body)["choices"][0]["message"]["content"] == "second"
        assert len(upstream.connections) == 1  # the same upstream connection, reused
        line = await proxy.line_for("second")
        assert (line["outcome"], line["reason"], line["status"]) == ("ok", "complete", 200)
    finally:
        writer.close()


async def test_no_head_in_time_is_a_504_and_the_connection_closes(
    make_proxy: ProxyFactory, raw_upstreams: list[RawUpstream]
) -> None:
    async def second(connection: Connection) -> None:
        await connection.wait_closed_by_peer()  # no head: the proxy gives up and closes it

    proxy, upstream, reader, writer = await _warmed(make_proxy, raw_upstreams, second, first_byte_timeout=_FIRST_BYTE)
    try:
        writer.write(_request("late"))
        async with asyncio.timeout(WAIT):
            status, _, body = await _response(reader)
            await upstream.connections[0].closed.wait()
        assert status == 504
        message = orjson.loads(body)["error"]["message"]
        assert message == f"the upstream sent no response headers within {_FIRST_BYTE:g} s"
        line = await proxy.line_for("late")
        assert (line["outcome"], line["reason"]) == ("error", "first_byte_timeout")
        assert line["upstream_cancelled"] is True
    finally:
        writer.close()


async def test_an_upstream_that_closes_before_its_head_is_a_502(
    make_proxy: ProxyFactory, raw_upstreams: list[RawUpstream]
) -> None:
    async def second(connection: Connection) -> None:
        return  # closed without an answer

    proxy, _, reader, writer = await _warmed(make_proxy, raw_upstreams, second)
    try:
        writer.write(_request("closed"))
        async with asyncio.timeout(WAIT):
            status, _, _ = await _response(reader)
        assert status == 502
        line = await proxy.line_for("closed")
        assert (line["outcome"], line["reason"]) == ("error", "connect_failed")
    finally:
        writer.close()


async def test_a_client_that_leaves_during_the_wait_is_an_abort_and_the_upstream_is_cancelled(
    make_proxy: ProxyFactory, raw_upstreams: list[RawUpstream]
) -> None:
    asked = asyncio.Event()

    async def second(connection: Connection) -> None:
        asked.set()
        await connection.wait_closed_by_peer()

    proxy, upstream, _, writer = await _warmed(make_proxy, raw_upstreams, second)
    writer.write(_request("gone"))
    async with asyncio.timeout(WAIT):
        await asked.wait()
        writer.close()
        await upstream.connections[0].closed.wait()  # the proxy closed the upstream connection
    line = await proxy.line_for("gone")
    assert (line["outcome"], line["reason"]) == ("aborted", "client_disconnect")
    assert line["upstream_cancelled"] is True


async def test_shutdown_during_the_wait_is_a_503(make_proxy: ProxyFactory, raw_upstreams: list[RawUpstream]) -> None:
    asked = asyncio.Event()

    async def second(connection: Connection) -> None:
        asked.set()
        await connection.wait_closed_by_peer()

    proxy, _, reader, writer = await _warmed(make_proxy, raw_upstreams, second)
    try:
        writer.write(_request("stopped"))
        async with asyncio.timeout(WAIT):
            await asked.wait()
            assert proxy.state.interrupt_all() == 1
            status, headers, _ = await _response(reader)
        assert status == 503
        assert headers["connection"] == "close"
        line = await proxy.line_for("stopped")
        assert (line["outcome"], line["reason"]) == ("error", "shutdown")
    finally:
        writer.close()


async def test_a_body_still_arriving_goes_on_in_a_task(
    make_proxy: ProxyFactory, raw_upstreams: list[RawUpstream]
) -> None:
    content = "x" * 100_000  # past what is answered at once, and sent in two parts
    whole = response(200, chat_json(content))
    rest = asyncio.Event()

    async def second(connection: Connection) -> None:
        await connection.send(whole[:200])
        await rest.wait()
        await connection.send(whole[200:])

    proxy, _, reader, writer = await _warmed(make_proxy, raw_upstreams, second)
    try:
        writer.write(_request("parts"))
        async with asyncio.timeout(WAIT):
            await until(lambda: _client_connection(proxy).task is not None)  # the head came: a task waits for the rest
            rest.set()
            status, _, body = await _response(reader)
        assert status == 200
        assert orjson.loads(body)["choices"][0]["message"]["content"] == content
        line = await proxy.line_for("parts")
        assert (line["outcome"], line["reason"]) == ("ok", "complete")
    finally:
        writer.close()


async def test_a_stream_head_goes_on_in_a_task(make_proxy: ProxyFactory, raw_upstreams: list[RawUpstream]) -> None:
    chunk = (b'data: {"id":"x","object":"chat.completion.chunk","model":"m","choices":[{"index":0,'
             b'"delta":%s,"finish_reason":%s}]}\n\n')  # fmt: skip
    events = chunk % (b'{"content":"hi"}', b"null") + chunk % (b"{}", b'"stop"') + b"data: [DONE]\n\n"

    async def second(connection: Connection) -> None:
        await connection.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%s"
                              % (len(events), events))  # fmt: skip

    proxy, _, reader, writer = await _warmed(make_proxy, raw_upstreams, second)
    try:
        writer.write(_request("streamed"))
        async with asyncio.timeout(WAIT):
            status, headers, body = await _response(reader)
        assert status == 200
        assert headers["content-type"].startswith("text/event-stream")
        assert body == events
        line = await proxy.line_for("streamed")
        assert (line["outcome"], line["reason"]) == ("ok", "complete")
    finally:
        writer.close()
