"""Transparent forwarding: methods, paths, queries, headers, bodies, limits, upstream down."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import socket
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict
from support import WAIT, FakeUpstream, Proxy, ProxyFactory, ServeUpstream, paused_stream
from support.ports import free_port
from yarl import URL


async def _echo(http: aiohttp.ClientSession, url: str | URL, method: str = "GET", **kwargs: Any) -> dict[str, Any]:
    async with http.request(method, url, **kwargs) as resp:
        assert resp.status == 200, await resp.text()
        data: dict[str, Any] = await resp.json()
        data["_response_headers"] = CIMultiDict(resp.headers)
        return data


@pytest.mark.parametrize("method", ["GET", "POST", "PUT", "PATCH", "DELETE"])
async def test_methods_and_bodies_pass(proxy: Proxy, http: aiohttp.ClientSession, method: str) -> None:
    body = b"" if method in ("GET", "DELETE") else b'{"payload": "\xc3\xa9t\xc3\xa9"}'
    echo = await _echo(http, f"{proxy.url}/_fake/echo", method, data=body)
    assert echo["method"] == method
    assert echo["path"] == "/_fake/echo"
    assert base64.b64decode(echo["body"]) == body


@pytest.mark.parametrize(
    "query",
    ["a=1&b=2", "a=%2F%2f&b=x+y&c=%E2%82%AC&d=&&e", "q=%ZZ%", "list[]=1&list[]=2;x=%20", "s='\"<>`{}|^"],
)
async def test_query_string_is_forwarded_byte_for_byte(proxy: Proxy, http: aiohttp.ClientSession, query: str) -> None:
    url = URL(f"{proxy.url}/_fake/echo?{query}", encoded=True)
    echo = await _echo(http, url)
    assert echo["query"] == query


async def test_header_rules(proxy: Proxy, http: aiohttp.ClientSession, fake_upstream: FakeUpstream) -> None:
    headers = {
        "Connection": "keep-alive, X-Hop",
        "X-Hop": "secret-hop",
        "Keep-Alive": "timeout=5",
        "TE": "trailers",
        "Trailer": "X-Foo",
        "Upgrade": "h2c",
        "Proxy-Authorization": "Basic abc",
        "Authorization": "Bearer sk-test",
        "X-Custom": "kept",
        "X-Forwarded-For": "203.0.113.7",
        "X-Request-Id": "req-abc-123",
    }
    echo = await _echo(http, f"{proxy.url}/_fake/echo", headers=headers)
    seen = {k.lower(): v for k, v in echo["headers"].items()}
    for gone in ("x-hop", "keep-alive", "te", "trailer", "upgrade"):
        assert gone not in seen, gone
    assert seen["proxy-authorization"] == "Basic abc"
    assert seen["authorization"] == "Bearer sk-test"
    assert seen["x-custom"] == "kept"
    assert seen["host"] == URL(fake_upstream.url).raw_authority
    assert seen["x-forwarded-for"] == "203.0.113.7, 127.0.0.1"
    assert seen["x-forwarded-proto"] == "http"
    assert seen["x-forwarded-host"] == URL(proxy.url).raw_authority
    assert seen["x-request-id"] == "req-abc-123"
    assert echo["_response_headers"]["X-Request-Id"] == "req-abc-123"


async def test_request_id_is_made_when_absent(proxy: Proxy, http: aiohttp.ClientSession) -> None:
    echo = await _echo(http, f"{proxy.url}/_fake/echo")
    made = echo["headers"].get("X-Request-Id") or echo["headers"].get("x-request-id")
    assert made
    assert echo["_response_headers"]["X-Request-Id"] == made


async def test_hop_by_hop_response_headers_are_dropped(
    serve_upstream: ServeUpstream, make_proxy: ProxyFactory, http: aiohttp.ClientSession
) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(
            text="ok",
            headers={"Connection": "X-Secret", "X-Secret": "hop", "Retry-After": "3", "X-RateLimit-Limit": "10"},
        )

    proxy = await make_proxy(upstream=await serve_upstream(handler))
    async with http.get(f"{proxy.url}/x") as resp:
        assert await resp.text() == "ok"
        assert "X-Secret" not in resp.headers
        assert resp.headers["Retry-After"] == "3"
        assert resp.headers["X-RateLimit-Limit"] == "10"


async def test_upstream_path_prefix(
    serve_upstream: ServeUpstream, make_proxy: ProxyFactory, http: aiohttp.ClientSession
) -> None:
    seen: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.raw_path)
        return web.json_response({"object": "list", "data": []})

    proxy = await make_proxy(upstream=await serve_upstream(handler) + "/prefix")
    async with http.get(URL(f"{proxy.url}/v1/models?x=%2F", encoded=True)) as resp:
        assert resp.status == 200
    assert seen == ["/prefix/v1/models?x=%2F"]


async def test_status_reason_and_rate_limit_headers_pass(proxy: Proxy, http: aiohttp.ClientSession) -> None:
    async with http.post(
        f"{proxy.url}/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-fault": "upstream_429"},
    ) as resp:
        assert resp.status == 429
        assert resp.headers["Retry-After"] == "1"
        assert resp.headers["x-ratelimit-remaining-requests"] == "0"
        body = await resp.json()
        assert body["error"]["type"] == "rate_limit_error" or body["error"]["message"]


async def test_body_over_the_limit_gets_413_and_reaches_nobody(
    make_proxy: ProxyFactory, http: aiohttp.ClientSession, fake_upstream: FakeUpstream
) -> None:
    proxy = await make_proxy(max_body_size=1024)
    before = len(fake_upstream.recorder.all())
    async with http.post(f"{proxy.url}/v1/chat/completions", data=b"x" * 4096) as resp:
        assert resp.status == 413
        body = await resp.json()
        assert body["error"]["type"] == "invalid_request_error"
        assert "limit" in body["error"]["message"]

    async def chunked() -> Any:
        for _ in range(8):
            yield b"y" * 512

    async with http.post(f"{proxy.url}/v1/chat/completions", data=chunked()) as resp:
        assert resp.status == 413
    assert len(fake_upstream.recorder.all()) == before
    assert proxy.log_lines()[-1]["reason"] == "body_too_large"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/anything"])
async def test_upstream_down_gives_502_json(make_proxy: ProxyFactory, http: aiohttp.ClientSession, path: str) -> None:
    proxy = await make_proxy(upstream=f"http://127.0.0.1:{free_port()}")
    async with http.post(f"{proxy.url}{path}", json={"model": "m", "stream": True}) as resp:
        assert resp.status == 502
        assert resp.content_type == "application/json"
        body = await resp.json()
        assert body["error"]["message"]
        assert "Traceback" not in str(body)
    line = proxy.log_lines()[-1]
    assert (line["outcome"], line["reason"], line["status"]) == ("error", "connect_failed", 502)


async def test_first_byte_timeout_gives_504_json(make_proxy: ProxyFactory, http: aiohttp.ClientSession) -> None:
    proxy = await make_proxy(first_byte_timeout=0.3)
    async with http.post(
        f"{proxy.url}/v1/chat/completions",
        json={"model": "m", "messages": []},
        headers={"x-fault": "late_headers;delay=5"},
    ) as resp:
        assert resp.status == 504
        body = await resp.json()
        assert body["error"]["type"] == "timeout_error"
    assert proxy.log_lines()[-1]["reason"] == "first_byte_timeout"


async def test_first_event_reaches_the_client_before_the_upstream_writes_the_second(
    serve_upstream: ServeUpstream, make_proxy: ProxyFactory, http: aiohttp.ClientSession
) -> None:
    go_on = asyncio.Event()

    opening = b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n'
    handler = paused_stream(opening, go_on)
    proxy = await make_proxy(upstream=await serve_upstream(handler))
    async with http.post(f"{proxy.url}/v1/chat/completions", json={"stream": True}) as resp:
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        assert b'"content":"a"' in first
        go_on.set()
        rest = await asyncio.wait_for(resp.content.read(), 5)
    assert rest.endswith(b"data: [DONE]\n\n")


async def test_hundred_concurrent_streams(proxy: Proxy, http: aiohttp.ClientSession) -> None:
    async def one(i: int) -> bytes:
        async with http.post(
            f"{proxy.url}/v1/chat/completions",
            json={"model": "m", "stream": True, "max_tokens": 20, "messages": [{"role": "user", "content": str(i)}]},
        ) as resp:
            assert resp.status == 200
            return await resp.read()

    bodies = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(100))), 60)
    assert all(body.endswith(b"data: [DONE]\n\n") for body in bodies)
    lines = proxy.log_lines()
    assert len(lines) == 100
    assert {(line["outcome"], line["reason"]) for line in lines} == {("ok", "complete")}


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def test_large_download_streams_with_flat_memory(proxy: Proxy, http: aiohttp.ClientSession) -> None:
    size = 200 * 1024 * 1024
    baseline = _rss_bytes()
    peak = baseline
    received = 0
    async with http.get(f"{proxy.url}/_fake/download?bytes={size}") as resp:
        assert resp.status == 200
        async for chunk in resp.content.iter_chunked(256 * 1024):
            received += len(chunk)
            peak = max(peak, _rss_bytes()) if received % (8 * 1024 * 1024) < len(chunk) else peak
    assert received == size
    assert peak - baseline < 32 * 1024 * 1024, f"RSS grew by {(peak - baseline) / 2**20:.1f} MiB"


async def test_json_body_beyond_the_bound_passes_unjudged(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(max_body_size=2048)
    body = {"model": "m", "input": [f"text {i}" for i in range(60)]}
    async with http.post(f"{fake_upstream.url}/v1/embeddings", json=body) as resp:
        direct = await resp.read()
    async with http.post(f"{proxy.url}/v1/embeddings", json=body) as resp:
        assert resp.status == 200
        through = await resp.read()
    assert len(direct) > 2048
    assert through == direct
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"], line["bytes_out"]) == ("ok", "complete", len(direct))


async def test_connect_timeout_gives_504(make_proxy: ProxyFactory, http: aiohttp.ClientSession) -> None:
    """A listener whose accept queue is full drops SYNs: the connect hangs until --connect-timeout."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = []
        try:
            for _ in range(4):
                filler = socket.socket()
                filler.setblocking(False)
                fillers.append(filler)
                with contextlib.suppress(BlockingIOError):
                    filler.connect(("127.0.0.1", port))
            proxy = await make_proxy(upstream=f"http://127.0.0.1:{port}", connect_timeout=0.3)
            started = asyncio.get_running_loop().time()
            async with http.post(f"{proxy.url}/v1/chat/completions", json={"model": "m"}) as resp:
                assert resp.status == 504
                body = await resp.json()
            elapsed = asyncio.get_running_loop().time() - started
        finally:
            for filler in fillers:
                filler.close()
    assert body["error"]["type"] == "timeout_error"
    assert "connect" in body["error"]["message"]
    assert 0.25 < elapsed < WAIT  # without the timeout, the kernel retries the SYN for about two minutes
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"], line["upstream_status"]) == ("error", "first_byte_timeout", None)


async def test_reason_phrase_passes(
    serve_upstream: ServeUpstream, make_proxy: ProxyFactory, http: aiohttp.ClientSession
) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=299, reason="Custom Reason", text="x")

    proxy = await make_proxy(upstream=await serve_upstream(handler))
    async with http.get(f"{proxy.url}/x") as resp:
        assert (resp.status, resp.reason) == (299, "Custom Reason")


async def test_upstream_pool_limit(make_proxy: ProxyFactory, fake_upstream: FakeUpstream) -> None:
    """--upstream-max-connections 2: a third stream waits for a free connection (no third socket)."""
    proxy = await make_proxy(upstream_max_connections=2, hold_headers=0)
    async with aiohttp.ClientSession() as http:
        body = {"model": "m", "stream": True, "messages": []}
        slow = {"x-fault": "slow;rate=20;tokens=1000"}
        first = await http.post(f"{proxy.url}/v1/chat/completions", json=body, headers=slow)
        second = await http.post(f"{proxy.url}/v1/chat/completions", json=body, headers=slow)
        third = asyncio.ensure_future(
            http.post(f"{proxy.url}/v1/chat/completions", json=body, headers={"X-Request-Id": "third"})
        )
        # A negative check has no event to wait on: give a third connection ample time to appear.
        await asyncio.sleep(0.2)
        assert fake_upstream.recorder.get("third") is None
        first.close()
        third_resp = await asyncio.wait_for(third, WAIT)
        assert (await third_resp.read()).endswith(b"data: [DONE]\n\n")
        second.close()


async def test_expect_100_continue_is_answered_by_the_proxy(proxy: Proxy, fake_upstream: FakeUpstream) -> None:
    """curl sends `Expect: 100-continue` for bodies over 1 KiB; the proxy answers it and sends the body whole."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 4000 + b'"}]}'
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    try:
        writer.write(
            b"POST /_fake/echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        await writer.drain()
        assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"HTTP/1.1 100")
        await asyncio.wait_for(reader.readline(), 5)  # the blank line after the interim response
        writer.write(body)
        await writer.drain()
        assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"HTTP/1.1 200")
    finally:
        writer.close()
    record = fake_upstream.recorder.all()[-1]
    assert "expect" not in {name.lower() for name in record.headers}


async def test_dialect_requests_ask_the_upstream_for_uncompressed_bodies(
    proxy: Proxy, http: aiohttp.ClientSession, fake_upstream: FakeUpstream
) -> None:
    async with http.post(
        f"{proxy.url}/v1/chat/completions", json={"model": "m", "messages": []},
        headers={"Accept-Encoding": "gzip, br", "X-Request-Id": "enc-1"},
    ) as resp:
        assert resp.status == 200
    record = fake_upstream.recorder.get("enc-1")
    assert record is not None
    assert "accept-encoding" not in {name.lower() for name in record.headers}
    echo = await _echo(http, f"{proxy.url}/_fake/echo", headers={"Accept-Encoding": "gzip"})
    assert {k.lower(): v for k, v in echo["headers"].items()}["accept-encoding"] == "gzip"  # other paths: as sent


async def test_a_compressed_event_stream_passes_untouched(
    serve_upstream: ServeUpstream, make_proxy: ProxyFactory, http: aiohttp.ClientSession
) -> None:
    """An upstream that compresses SSE anyway: the proxy cannot read it, so it copies it through."""
    plain = b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
    packed = gzip.compress(plain)

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=packed, headers={"Content-Type": "text/event-stream", "Content-Encoding": "gzip"})

    proxy = await make_proxy(upstream=await serve_upstream(handler))
    async with http.post(f"{proxy.url}/v1/chat/completions", json={"stream": True}) as resp:
        assert resp.headers["Content-Encoding"] == "gzip"
        assert await resp.read() == plain  # the client decompresses what the upstream compressed
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"]) == ("ok", "complete")


async def _cut_body_upstream(serve_upstream: ServeUpstream, content_type: str) -> str:
    """An upstream that announces 100 000 bytes, sends 10, then closes the connection."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": content_type})
        resp.content_length = 100_000
        await resp.prepare(request)
        await resp.write(b'{"id": "x"')
        assert request.transport is not None
        request.transport.close()
        return resp

    return await serve_upstream(handler)


async def test_whole_json_body_cut_short_is_a_502(
    serve_upstream: ServeUpstream, make_proxy: ProxyFactory, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(upstream=await _cut_body_upstream(serve_upstream, "application/json"))
    async with http.post(f"{proxy.url}/v1/chat/completions", json={"model": "m", "messages": []}) as resp:
        assert resp.status == 502
        body = await resp.json()
    assert body["error"]["code"] == "stream_cut"
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"]) == ("error", "stream_cut")


async def test_passed_through_body_cut_short_cuts_the_client_too(
    serve_upstream: ServeUpstream, make_proxy: ProxyFactory, http: aiohttp.ClientSession
) -> None:
    """A body copied through (here an `other` path) can only be cut: the client must see it broken."""
    proxy = await make_proxy(upstream=await _cut_body_upstream(serve_upstream, "application/octet-stream"))
    async with http.get(f"{proxy.url}/files/model.bin") as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"]) == ("error", "stream_cut")
