"""`streamwarden bench`'s cancellation figure: how soon the backend sees a departed client's close.

Each probe opens a long stream through the proxy, reads its first event, closes the connection and
notes the time; the built-in fake upstream records (on its own socket) when it saw the proxy close the
upstream connection. Both read CLOCK_MONOTONIC, which Linux shares across processes, so the difference
is the disconnect-to-upstream-close latency.

Probes run one at a time while `background` other streams flow through the proxy, so the figure is
the proxy's reaction under load. (Firing the probes concurrently mostly measures the queueing of this
Python client and of the fake upstream's event loop: the same latencies appear without the proxy.)
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson

__all__ = ["measure_abandons"]

_BODY = orjson.dumps({"model": "m", "stream": True, "max_tokens": 5000, "messages": []})
_HEADERS = {"x-fault": "slow;rate=50;tokens=5000", "Content-Type": "application/json"}


async def _abandon(session: aiohttp.ClientSession, proxy: str, request_id: str) -> float:
    headers = {**_HEADERS, "X-Request-Id": request_id}
    resp = await session.post(proxy + "/v1/chat/completions", data=_BODY, headers=headers)
    try:
        await resp.content.readuntil(b"\n\n")
    finally:
        closed_at = time.monotonic()
        resp.close()
    return closed_at


async def _records(session: aiohttp.ClientSession, fake: str, ids: set[str]) -> dict[str, dict[str, object]]:
    """The fake's records of `ids`, once all of them finished (polled rarely: polling is load too)."""
    found: dict[str, dict[str, object]] = {}
    for _ in range(100):
        async with session.get(f"{fake}/_fake/requests") as resp:
            records = orjson.loads(await resp.read()) if resp.status == 200 else []
        found = {r["request_id"]: r for r in records if r.get("request_id") in ids}
        if len(found) == len(ids) and all(r.get("finished_at") is not None for r in found.values()):
            break
        await asyncio.sleep(0.1)
    return found


async def _background(session: aiohttp.ClientSession, proxy: str, stop: asyncio.Event) -> None:
    """A long stream read to its end (or until `stop`), to keep the proxy busy meanwhile."""
    while not stop.is_set():
        async with session.post(proxy + "/v1/chat/completions", data=_BODY, headers=_HEADERS) as resp:
            async for _ in resp.content.iter_any():
                if stop.is_set():
                    break


async def measure_abandons(proxy: str, fake: str, count: int, background: int) -> tuple[list[float], int]:
    """Latencies (seconds) of `count` abandons, and how many upstreams were never seen to close."""
    closed: dict[str, float] = {}
    prefix = f"bench-abandon-{time.monotonic_ns()}"
    stop = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        load = [asyncio.ensure_future(_background(session, proxy, stop)) for _ in range(background)]
        try:
            for i in range(count):
                request_id = f"{prefix}-{i}"
                closed[request_id] = await _abandon(session, proxy, request_id)
        finally:
            stop.set()
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)
        records = await _records(session, fake, set(closed))
    latencies = []
    for request_id, closed_at in closed.items():
        seen = records.get(request_id, {}).get("client_closed_at")
        if isinstance(seen, int | float):
            latencies.append(seen - closed_at)
    return sorted(latencies), count - len(latencies)
