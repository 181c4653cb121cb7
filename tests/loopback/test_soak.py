"""Soak: 300 concurrent streams, a third abandoned at random points.

Afterwards every abandoned request's upstream connection was closed by the proxy (seen from the fake
upstream's own socket), the proxy's books balance, the open file descriptors are back near their
baseline, and nothing hangs. How soon the upstream is closed is a figure, not a contract: `streamwarden
bench` measures it (its "client leaves -> upstream closed" line); the only bounds here are the waits'
timeouts, which only a hang exceeds.
"""

from __future__ import annotations

import asyncio
import os
import random

import aiohttp
from support import FakeUpstream, Proxy, until

STREAMS = 300
TOKENS = 60


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _peak_rss_mib() -> float:
    """VmHWM of this process: the client, the proxy and the fake upstream together."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def test_soak_with_abandons(proxy: Proxy, fake_upstream: FakeUpstream) -> None:
    rng = random.Random(1234)
    abandon_after = {i: rng.randint(1, TOKENS - 5) for i in rng.sample(range(STREAMS), STREAMS // 3)}
    abandoned: list[str] = []
    baseline = _open_fds()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:

        async def one(i: int) -> None:
            rid = f"soak-{i}"
            body = {"model": "m", "stream": True, "max_tokens": TOKENS, "messages": []}
            headers = {"X-Request-Id": rid, "x-fake-rate": "100"}
            async with http.post(f"{proxy.url}/v1/chat/completions", json=body, headers=headers) as resp:
                assert resp.status == 200
                if i not in abandon_after:
                    assert (await resp.read()).endswith(b"data: [DONE]\n\n")
                    return
                for _ in range(abandon_after[i]):
                    await resp.content.readuntil(b"\n\n")
                abandoned.append(rid)
                resp.close()

        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(STREAMS))), 60)
        records = [await fake_upstream.recorder.wait_finished(rid, timeout=10) for rid in abandoned]
    assert len(records) == STREAMS // 3
    assert all(r.client_closed_at is not None for r in records), "every abandoned upstream was closed"
    assert all(r.events_sent < TOKENS + 3 for r in records)

    lines = await proxy.settled()
    assert len(lines) == STREAMS
    outcomes = [(line["outcome"], line["reason"]) for line in lines]
    assert outcomes.count(("aborted", "client_disconnect")) == STREAMS // 3
    assert outcomes.count(("ok", "complete")) == STREAMS - STREAMS // 3
    assert proxy.sample("streamwarden_inflight_requests", {"api": "chat_completions"}) == 0
    assert not proxy.state.live

    pooled = _open_fds() - baseline
    # Finished streams leave keep-alive connections in the upstream pool (and their server ends in
    # the fake): legitimate. Close the pool; whatever stays open beyond the baseline is a leak.
    proxy.state.upstream.close()
    await until(lambda: _open_fds() <= baseline + 10)  # the fake's ends close as it reads the EOFs
    after = _open_fds()
    print(f"\nsoak: {STREAMS} streams, {len(abandoned)} abandoned; fds {baseline} -> {after} "
          f"(+{pooled} with the keep-alive pool open); peak RSS of the whole test process {_peak_rss_mib():.0f} MiB")
