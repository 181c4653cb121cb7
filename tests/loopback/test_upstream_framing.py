"""The upstream response's framing, from a raw-socket upstream.

A chunked body's trailers are dropped (nginx does not pass them): a trailer `Set-Cookie` or
`Location` must never reach the client as a header. A `Transfer-Encoding` is chunked only when
`chunked` is its final coding, as a whole token (RFC 9112 6.3): `chunked, gzip` and `xchunked`
bodies are framed by the close, so they arrive whole, not as a cut chunked body.
"""

from __future__ import annotations

import aiohttp
import pytest
from support import ProxyFactory
from support.hostile import Connection, RawUpstream

BODY = b'{"object": "list", "data": []}'


def _upstream(head: bytes, body: bytes, *, close: bool) -> RawUpstream:
    async def script(connection: Connection) -> None:
        while await connection.next_request() is not None:
            await connection.send(head + body)
            if close:
                return  # the close ends the body

    return RawUpstream(script)


async def _get(make_proxy: ProxyFactory, upstream: RawUpstream, started: list[RawUpstream]) -> tuple[
        aiohttp.ClientResponse, bytes, dict[str, object]]:  # fmt: skip
    started.append(upstream)
    proxy = await make_proxy(upstream=await upstream.start())
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
        async with http.get(proxy.url + "/files/blob", headers={"X-Request-Id": "framing"}) as response:
            body = await response.read()
    return response, body, await proxy.line_for("framing")


async def test_chunked_trailers_never_become_response_headers(
    make_proxy: ProxyFactory, raw_upstreams: list[RawUpstream]
) -> None:
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
            b"Trailer: Set-Cookie, Location\r\n\r\n")  # fmt: skip
    body = b"%x\r\n%s\r\n0\r\nSet-Cookie: session=stolen\r\nLocation: http://evil.example/\r\nX-Tr: 1\r\n\r\n" % (
        len(BODY), BODY)  # fmt: skip
    response, received, line = await _get(make_proxy, _upstream(head, body, close=False), raw_upstreams)
    assert (response.status, received) == (200, BODY)
    assert "Set-Cookie" not in response.headers
    assert "Location" not in response.headers
    assert "X-Tr" not in response.headers
    assert (line["outcome"], line["reason"]) == ("ok", "complete")


@pytest.mark.parametrize("coding", [b"chunked, gzip", b"xchunked", b"gzip, xchunked"])
async def test_a_transfer_encoding_not_ending_in_chunked_is_framed_by_the_close(
    make_proxy: ProxyFactory, raw_upstreams: list[RawUpstream], coding: bytes
) -> None:
    raw = b"5\r\nhello\r\n0\r\n\r\n"  # chunk-like bytes that are the body itself, not its framing
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: %s\r\n\r\n" % coding
    response, received, line = await _get(make_proxy, _upstream(head, raw, close=True), raw_upstreams)
    assert response.status == 200
    assert received == raw
    assert line["reason"] != "stream_cut"
