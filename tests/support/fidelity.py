"""What the real tiers do alike to any backend: compare its answers direct and through the proxy, and
leave a stream the way a client that gives up does.

The llama-server and the vLLM tiers prove the same two things against different servers, so the means
are one: the answers are compared without what two identical requests never share (each backend has
its own such keys), and an abandoned stream is closed after a number of content events, not a time.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai

__all__ = ["abandon_after", "normalise", "openai_client"]


def normalise(value: Any, volatile: frozenset[str]) -> Any:
    """A dumped SDK object without the `volatile` keys (ids, timestamps), at every depth."""
    if isinstance(value, dict):
        return {k: normalise(v, volatile) for k, v in value.items() if k not in volatile}
    if isinstance(value, list):
        return [normalise(v, volatile) for v in value]
    return value


def openai_client(base: str, timeout: float) -> openai.AsyncOpenAI:
    """The SDK as a test uses it: no retries (a retry would hide the first answer), a bounded wait."""
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=timeout)


async def abandon_after(
    base: str, body: dict[str, Any], received: int, *, within: float, headers: dict[str, str] | None = None
) -> None:
    """Stream the chat completion `body`; close the connection once `received` content events arrived."""
    async with aiohttp.ClientSession() as http:
        resp = await http.post(base + "/v1/chat/completions", json=body, headers=headers or {})
        assert resp.status == 200
        seen = 0
        async with asyncio.timeout(within):
            while seen < received:
                seen += b'"content"' in await resp.content.readuntil(b"\n\n")
        resp.close()
