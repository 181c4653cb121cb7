"""`--on-abandon drain`: after the client left, read the upstream's answer to its end for its usage.

For operators who must bill every token: the upstream is not cancelled; its response is read (still
bounded by --first-byte-timeout and --idle-timeout, and never written anywhere), its usage recorded,
and the outcome stays `aborted`. Cancelling is the default and the cheaper choice.
"""

from __future__ import annotations

import asyncio

import aiohttp

from .body import judge_body
from .dialects import Dialect, RequestInfo
from .exchange import Exchange
from .guard import StreamGuard

__all__ = ["drain_stream", "drain_whole"]

_READ_ERRORS = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, OSError, TimeoutError)


async def drain_stream(reader: aiohttp.StreamReader, guard: StreamGuard, idle_timeout: float) -> None:
    """Feed the rest of the stream to the guard (for usage and counts) until it ends or stalls."""
    try:
        while not guard.done:
            async with asyncio.timeout(idle_timeout):
                chunk = await reader.readany()
            if not chunk:
                guard.end_of_stream()
                return
            guard.feed(chunk)
    except _READ_ERRORS:
        return


async def drain_whole(
    upstream: aiohttp.ClientResponse, dialect: Dialect, info: RequestInfo, ex: Exchange, limit: int, idle: float
) -> None:
    """Read a whole JSON body (bounded) just to take its usage."""
    chunks: list[bytes] = []
    size = 0
    try:
        while size <= limit:
            async with asyncio.timeout(idle):
                chunk = await upstream.content.readany()
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        else:
            return
    except _READ_ERRORS:
        return
    verdict = judge_body(dialect, info, upstream.status, upstream.headers.get("Content-Type"), b"".join(chunks))
    if verdict.usage is not None:
        ex.prompt_tokens = verdict.usage.prompt_tokens
        ex.completion_tokens = verdict.usage.completion_tokens
