"""What an exchange leaves behind once it is over: nothing the cyclic garbage collector must find.

An exchange whose objects hold each other in a cycle (a hook that holds the exchange, held by the
request) is freed only by a collection, which walks the whole heap; one freed by refcounting costs
nothing more. With the collector off, every record still alive after the exchanges ended is one
that only a collection would free.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import aiohttp
import pytest
from support import Proxy

from proxy.core.record import ExchangeRecord

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _records() -> int:
    return sum(1 for obj in gc.get_objects() if type(obj) is ExchangeRecord)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_an_ended_exchange_is_freed_without_the_collector(
    proxy: Proxy, http: aiohttp.ClientSession, collector_off: None, stream: bool
) -> None:
    before = _records()
    for _ in range(5):
        async with http.post(f"{proxy.url}/v1/chat/completions", json={**CHAT, "stream": stream}) as resp:
            assert resp.status == 200
            await resp.read()
    await proxy.settled()
    assert _records() == before


async def test_a_refused_exchange_is_freed_without_the_collector(
    proxy: Proxy, http: aiohttp.ClientSession, collector_off: None
) -> None:
    before = _records()
    for _ in range(5):
        async with http.post(f"{proxy.url}/v1/chat/completions", data=b"{not json", headers={
            "Content-Type": "application/json", "x-fault": "status:500"}) as resp:
            await resp.read()
    await proxy.settled()
    assert _records() == before
