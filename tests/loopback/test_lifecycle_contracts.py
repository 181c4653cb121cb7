"""Contract bugs that scattered verdicts produced, now one lifecycle decides (each reproduced on loopback).

1. Shutdown reaching a committed whole body was logged aborted/client_disconnect but counted as a
   shutdown cancellation; it is error/shutdown, counted once.
2. A whole body that stalls was a 502 stream_cut with nothing cancelled; it is a 504 stall_timeout
   with the upstream cancelled and counted, before the commit and after it.
(3 and 4, the upstream's own error code and Responses' sequence numbers, are in the guard tests.)
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from support import Proxy, ProxyFactory
from support.hostile import WAIT, Connection, RawUpstream

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _half_then_silence(content_type: bytes) -> tuple[RawUpstream, asyncio.Event]:
    """An upstream that answers 200 with half of a declared body, then says nothing until closed."""
    closed_by_proxy = asyncio.Event()

    async def script(connection: Connection) -> None:
        await connection.next_request()
        await connection.send(b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: 100\r\n\r\n" % content_type
                              + b"x" * 50)
        await connection.wait_closed_by_peer()
        closed_by_proxy.set()

    return RawUpstream(script), closed_by_proxy


def _cancellations(proxy: Proxy, api: str) -> dict[str, float]:
    reasons = ("client_disconnect", "client_stalled", "stall_timeout", "first_byte_timeout", "shutdown",
               "upstream_error")
    found = {r: proxy.sample("streamwarden_upstream_cancellations_total", {"api": api, "reason": r}) for r in reasons}
    return {reason: count for reason, count in found.items() if count}


async def test_shutdown_reaching_a_committed_whole_body_is_an_error_counted_once(
    make_proxy: ProxyFactory, http: aiohttp.ClientSession
) -> None:
    upstream, closed = _half_then_silence(b"application/octet-stream")
    proxy = await make_proxy(upstream=await upstream.start(), drain_timeout=0.2, idle_timeout=60)
    try:
        async with http.get(f"{proxy.url}/files/big", headers={"X-Request-Id": "shut-whole"}) as resp:
            assert resp.status == 200  # committed: the copy-through has begun
            assert await resp.content.readexactly(50) == b"x" * 50
            proxy.server.request_stop()
            shutting = asyncio.create_task(proxy.server.shutdown())
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()  # the client is cut: nothing else can say a plain body broke
        async with asyncio.timeout(WAIT):
            await shutting
            await closed.wait()
        line = await proxy.line_for("shut-whole")
        assert (line["outcome"], line["reason"], line["status"]) == ("error", "shutdown", 200)
        assert line["upstream_cancelled"] is True
        assert _cancellations(proxy, "other") == {"shutdown": 1}
    finally:
        await upstream.close()


@pytest.mark.parametrize(
    ("path", "content_type", "committed"),
    [("/v1/chat/completions", b"application/json", False), ("/files/big", b"application/octet-stream", True)],
    ids=["judged-before-commit", "copied-after-commit"],
)
async def test_a_whole_body_that_stalls_is_stall_timeout_and_cancelled(
    make_proxy: ProxyFactory, http: aiohttp.ClientSession, path: str, content_type: bytes, committed: bool
) -> None:
    upstream, closed = _half_then_silence(content_type)
    proxy = await make_proxy(upstream=await upstream.start(), idle_timeout=0.3)
    try:
        rid = f"stall-{committed}"
        async with http.post(f"{proxy.url}{path}", json=CHAT, headers={"X-Request-Id": rid}) as resp:
            if committed:
                assert resp.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()
            else:
                assert resp.status == 504
                assert (await resp.json())["error"]["code"] == "stall_timeout"
        async with asyncio.timeout(WAIT):
            await closed.wait()  # the upstream was cancelled: its connection closed
        line = await proxy.line_for(rid)
        assert (line["outcome"], line["reason"]) == ("error", "stall_timeout")
        assert line["upstream_cancelled"] is True
        api = "other" if committed else "chat_completions"
        assert _cancellations(proxy, api) == {"stall_timeout": 1}
    finally:
        await upstream.close()
