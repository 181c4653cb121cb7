"""`streamwarden bench`'s abandon test: how soon the backend sees a departed client's close, under load.

`streams` streams at the real LLM pace run at once; a third of them (chosen with a seeded random
generator, so every target gets the same plan) are abandoned after a random number of events: the
client closes its connection and notes `time.monotonic()`. The fast fake notes, on its own socket,
when the connection of a stream that had not ended closed. Both read CLOCK_MONOTONIC, which Linux
shares across processes, so the difference is the client-close-to-upstream-close latency as the
upstream sees it. Direct, that is just the fake's own reaction; through a proxy, the proxy's on top.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import orjson
from yarl import URL

from proxy.tools.bench.client import Client, Exchange, build_request
from proxy.tools.bench.targets import Target

__all__ = ["AbandonResult", "abandon_plan", "measure_abandons"]

CLOSE_WAIT = 10.0  # seconds to wait for the fake to see every close


@dataclass
class AbandonResult:
    latencies: list[float] = field(default_factory=list)  # seconds, one per abandon the fake saw close
    missed: int = 0  # abandons whose upstream connection was never seen to close
    ended_first: int = 0  # abandons whose upstream stream had already ended (no close to time)
    failed: int = 0  # streams that were not abandoned but did not end cleanly


def abandon_plan(streams: int, seed: int, tokens: int) -> dict[int, int]:
    """Stream index -> the number of events after which it is abandoned (a third of the streams)."""
    rng = random.Random(seed)
    chosen = rng.sample(range(streams), streams // 3)
    return {index: rng.randint(1, tokens) for index in sorted(chosen)}


async def _closes(fake: URL) -> tuple[dict[str, float], set[str]]:
    assert fake.host is not None
    assert fake.port is not None
    reader, writer = await asyncio.open_connection(fake.host, fake.port)
    try:
        writer.write(f"GET /_fast/closes HTTP/1.1\r\nHost: {fake.host}\r\nConnection: close\r\n\r\n".encode())
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"the fast fake answered /_fast/closes with {head[:40]!r}")
    found = orjson.loads(body)
    return {str(k): float(v) for k, v in found["closed"].items()}, {str(i) for i in found["ended"]}


async def measure_abandons(target: Target, fake: URL, *, streams: int, delay_ms: int, tokens: int, seed: int,
                           label: str) -> AbandonResult:  # fmt: skip
    """One run of the abandon test against `target` (the fake at `fake` keeps the upstream's view)."""
    url = target.url
    assert url.host is not None
    assert url.port is not None
    plan = abandon_plan(streams, seed, tokens)
    body = orjson.dumps({"model": f"fast-{delay_ms}ms", "stream": True, "max_tokens": tokens,
                         "messages": [{"role": "user", "content": "Write a long story."}]})  # fmt: skip
    prefix = f"bench-abandon-{label}-{time.monotonic_ns()}"
    left: dict[str, float] = {}
    result = AbandonResult()

    async def one(index: int) -> None:
        client = Client(url.host or "", url.port or 0)
        request_id = f"{prefix}-{index}"
        headers = {"X-Request-Id": request_id, "x-fast-record": "1"}
        request = build_request(f"{url.host}:{url.port}", "/v1/chat/completions", body, headers)
        after = plan.get(index)

        def on_event(exchange: Exchange) -> None:
            if after is not None and exchange.events >= after and request_id not in left:
                left[request_id] = client.abandon()

        try:
            exchange = await client.send(request, 60, on_event)
        except OSError:
            result.failed += 1
            return
        finally:
            client.close()
        if after is None and (exchange.error is not None or not exchange.done or exchange.status != 200):
            result.failed += 1
        elif after is not None and request_id not in left:  # the stream ended before its abandon point
            left[request_id] = time.monotonic()

    async with asyncio.TaskGroup() as group:
        for index in range(streams):
            group.create_task(one(index))
    deadline = time.monotonic() + CLOSE_WAIT
    seen: dict[str, float] = {}
    ended: set[str] = set()
    while time.monotonic() < deadline:
        seen, ended = await _closes(fake)
        if all(request_id in seen or request_id in ended for request_id in left):
            break
        await asyncio.sleep(0.2)
    for request_id, closed_at in left.items():
        if request_id in seen:
            result.latencies.append(seen[request_id] - closed_at)
        elif request_id in ended:
            result.ended_first += 1
        else:
            result.missed += 1
    result.latencies.sort()
    return result
