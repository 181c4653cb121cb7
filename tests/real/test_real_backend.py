"""Against a real backend (vLLM, llama.cpp server, ...): set STREAMWARDEN_REAL_UPSTREAM=http://host:port.

Skipped otherwise. Checks the contract that only a real server can confirm: a normal stream through
the proxy completes with the backend's own terminal, the SDK sees the same text direct and proxied
(with temperature 0), and abandoning a stream closes the backend connection.
"""

from __future__ import annotations

import os

import aiohttp
import openai
import pytest
from support import ProxyFactory

REAL = os.environ.get("STREAMWARDEN_REAL_UPSTREAM", "").rstrip("/")
pytestmark = [
    pytest.mark.real,
    pytest.mark.skipif(not REAL, reason="set STREAMWARDEN_REAL_UPSTREAM=http://host:port to run"),
]


async def _model() -> str:
    async with aiohttp.ClientSession() as http, http.get(REAL + "/v1/models") as resp:
        data = await resp.json()
    return str(data["data"][0]["id"])


async def _text(base_url: str, model: str) -> str:
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model=model, stream=True, temperature=0, max_tokens=24,
            messages=[{"role": "user", "content": "Count from one to ten in words."}],
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


async def test_real_stream_same_direct_and_through(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(upstream=REAL)
    model = await _model()
    direct = await _text(REAL, model)
    through = await _text(proxy.url, model)
    assert through
    assert through == direct
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"]) == ("ok", "complete")


async def test_real_abandon_is_recorded(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(upstream=REAL)
    model = await _model()
    async with aiohttp.ClientSession() as http:
        resp = await http.post(proxy.url + "/v1/chat/completions", json={
            "model": model, "stream": True, "max_tokens": 512,
            "messages": [{"role": "user", "content": "Write a long story."}],
        })
        await resp.content.readuntil(b"\n\n")
        resp.close()
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"], line["upstream_cancelled"]) == ("aborted", "client_disconnect", True)
