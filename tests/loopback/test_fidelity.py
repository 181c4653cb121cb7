"""A healthy exchange through the proxy is byte-identical to the direct one, for every dialect."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from support import FakeUpstream, Proxy

MESSAGES = [{"role": "user", "content": "Say something."}]
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("chat", "/v1/chat/completions", {"model": "m", "messages": MESSAGES}),
    ("chat+usage", "/v1/chat/completions",
     {"model": "m", "messages": MESSAGES, "stream_options": {"include_usage": True}}),
    ("chat n=2", "/v1/chat/completions", {"model": "m", "messages": MESSAGES, "n": 2}),
    ("completions", "/v1/completions", {"model": "m", "prompt": "Once"}),
    ("completions batch", "/v1/completions", {"model": "m", "prompt": ["a", "b"], "n": 2}),
    ("completions+usage", "/v1/completions",
     {"model": "m", "prompt": "Once", "stream_options": {"include_usage": True}}),
    ("responses", "/v1/responses", {"model": "m", "input": "hello"}),
    ("messages", "/v1/messages", {"model": "m", "max_tokens": 16, "messages": MESSAGES}),
    ("no v1 prefix", "/chat/completions", {"model": "m", "messages": MESSAGES}),
]


async def _fetch(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, str, bytes]:
    async with http.post(url, json=body, headers={"X-Request-Id": "fixed-id"}) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), await resp.read()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize(("name", "path", "body"), CASES, ids=[case[0] for case in CASES])
async def test_proxy_bytes_equal_direct_bytes(
    proxy: Proxy, fake_upstream: FakeUpstream, http: aiohttp.ClientSession,
    name: str, path: str, body: dict[str, Any], stream: bool,
) -> None:
    body = {**body, "stream": stream}
    if not stream:
        body.pop("stream_options", None)
    direct = await _fetch(http, fake_upstream.url + path, body)
    through = await _fetch(http, proxy.url + path, body)
    assert direct[0] == 200
    assert through == direct
    if stream:
        assert direct[1].startswith("text/event-stream")
    line = proxy.log_lines()[-1]
    assert (line["outcome"], line["reason"]) == ("ok", "complete")


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/embeddings"), ("GET", "/v1/models"), ("GET", "/health")])
async def test_other_endpoints_identical(
    proxy: Proxy, fake_upstream: FakeUpstream, http: aiohttp.ClientSession, method: str, path: str
) -> None:
    kwargs: dict[str, Any] = {"json": {"model": "m", "input": ["a", "b"]}} if method == "POST" else {}
    async with http.request(method, fake_upstream.url + path, **kwargs) as resp:
        direct = resp.status, await resp.read()
    async with http.request(method, proxy.url + path, **kwargs) as resp:
        through = resp.status, await resp.read()
    assert through == direct
    assert direct[0] == 200
