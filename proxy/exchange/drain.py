"""`--on-abandon drain`: after the client left, read the upstream's answer to its end for its usage.

For operators who must bill every token. It runs as its own kept-referenced task, so that the
handler (cancelled by aiohttp when its client leaves) simply unwinds; the drain owns the upstream
response, is still bounded by --first-byte-timeout and --idle-timeout, writes nothing anywhere,
closes the upstream and then writes the exchange's books. The outcome stays `aborted`. Cancelling
is the default and the cheaper choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp

from proxy.core.body import judge_body
from proxy.core.dialects import Dialect, RequestInfo
from proxy.core.guard import StreamGuard
from proxy.core.record import ExchangeRecord
from proxy.exchange.failures import READ_ERRORS
from proxy.exchange.stream_io import count_stream, is_stream

__all__ = ["drain"]


async def drain(
    answer: Awaitable[aiohttp.ClientResponse],
    ex: ExchangeRecord,
    dialect: Dialect,
    info: RequestInfo,
    *,
    guard: StreamGuard | None,
    first_byte_timeout: float,
    idle_timeout: float,
    max_body_size: int,
    max_event_size: int,
    finish: Callable[[], None],
) -> None:
    """Wait for the upstream's answer (if it has not come yet), read it through, then `finish`."""
    upstream: aiohttp.ClientResponse | None = None
    try:
        async with asyncio.timeout(first_byte_timeout):
            upstream = await answer
        ex.upstream_status = upstream.status
        if is_stream(upstream):
            if guard is None:  # the client left before the stream began
                guard = StreamGuard(dialect, hold=False, max_event_size=max_event_size)
            await _read_through(upstream, idle_timeout, guard.feed, lambda: guard.done)
            guard.end_of_stream()
            count_stream(guard, ex)
        else:
            parts: list[bytes] = []
            size = 0

            def keep(chunk: bytes) -> None:
                nonlocal size
                parts.append(chunk)
                size += len(chunk)

            whole = await _read_through(upstream, idle_timeout, keep, lambda: size > max_body_size)
            if whole and size <= max_body_size:
                content_type = upstream.headers.get("Content-Type")
                ex.record_usage(judge_body(dialect, info, upstream.status, content_type, b"".join(parts)).usage)
    except (TimeoutError, aiohttp.ClientError, OSError):
        pass  # nothing more to learn: the books take what was read
    finally:
        if upstream is not None:
            upstream.close()
        finish()


async def _read_through(
    upstream: aiohttp.ClientResponse, idle: float, consume: Callable[[bytes], object], enough: Callable[[], bool]
) -> bool:
    """Feed the body to `consume` until it ends (True), stalls, breaks or is `enough` (False)."""
    reader = upstream.content
    try:
        while not enough():
            async with asyncio.timeout(idle):
                chunk = await reader.readany()
            if not chunk:
                return True
            consume(chunk)
    except (*READ_ERRORS, TimeoutError):
        return False
    return False
