"""A bug of the proxy's own must never show the client a traceback or a second HTTP response.

The bugs are simulated by making one of the proxy's own functions raise (never aiohttp's).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from support import ProxyFactory

from proxy.core.guard import Step, StreamGuard
from proxy.exchange import handler

# Compiled (scripts/mypyc_build.py), the handler and the relay call their modules' functions and the
# guard's methods directly: a patch of them reaches no call.
COMPILED = not handler.__file__.endswith(".py")
direct_call = pytest.mark.skipif(COMPILED, reason="the patched call is a direct one in the compiled build")

CHAT = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def _explode(*_: Any, **__: Any) -> Any:
    raise RuntimeError("simulated bug")


def _break_feed_at(monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    """The guard's `feed` works until its `call`-th use, which raises."""
    feed = StreamGuard.feed
    calls = 0

    def feed_then_break(self: StreamGuard, chunk: bytes) -> Step:
        nonlocal calls
        calls += 1
        if calls == call:
            raise RuntimeError("simulated bug")
        return feed(self, chunk)

    monkeypatch.setattr(StreamGuard, "feed", feed_then_break)


@direct_call
async def test_bug_before_the_status_line_is_a_500_in_the_dialect_shape(
    make_proxy: ProxyFactory, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = await make_proxy()
    monkeypatch.setattr(handler, "read_request", _explode)
    async with http.post(f"{proxy.url}/v1/messages", json=CHAT) as resp:
        assert resp.status == 500
        body = await resp.json()
    message = "the proxy failed to handle the request"
    assert body == {"type": "error", "error": {"type": "api_error", "message": message}}
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"], line["status"]) == ("error", "proxy_error", 500)
    assert "simulated bug" in proxy.log.getvalue()  # for the operator, in the log
    assert "simulated bug" not in str(body)


@direct_call
async def test_bug_mid_stream_ends_with_an_error_frame(
    make_proxy: ProxyFactory, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = await make_proxy(hold_headers=0)
    _break_feed_at(monkeypatch, 3)
    async with http.post(
        f"{proxy.url}/v1/chat/completions", json=CHAT, headers={"x-fault": "slow;rate=200;tokens=20"}
    ) as resp:
        assert resp.status == 200
        body = await resp.read()  # a clean end of the chunked body: no ClientPayloadError
    assert b"HTTP/1." not in body
    assert b'"code":"proxy_error"' in body
    assert body.endswith(b"data: [DONE]\n\n")
    assert "simulated bug" not in body.decode()
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"]) == ("error", "proxy_error")


@direct_call
async def test_bug_mid_stream_while_holding_is_a_500(
    make_proxy: ProxyFactory, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = await make_proxy()
    monkeypatch.setattr(StreamGuard, "feed", _explode)
    async with http.post(f"{proxy.url}/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 500
        body = await resp.json()
    assert body["error"]["code"] == "proxy_error"


@direct_call
async def test_bug_in_the_guard_itself_mid_stream_cuts_the_connection(
    make_proxy: ProxyFactory, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When not even an error frame can be built, the client must see a broken body, not a clean end."""
    proxy = await make_proxy(hold_headers=0)
    _break_feed_at(monkeypatch, 3)
    monkeypatch.setattr(StreamGuard, "fail", _explode)
    async with http.post(
        f"{proxy.url}/v1/chat/completions", json=CHAT, headers={"x-fault": "slow;rate=200;tokens=20"}
    ) as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"]) == ("error", "proxy_error")
