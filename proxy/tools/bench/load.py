"""`streamwarden bench`'s measured window: a fixed load against one target, with /proc read around it.

A `Scenario` is the shape (clients, requests, streaming or not, pace); `measure` runs it against one
target and returns a `Window`: what the clients saw, and the target's CPU time (its process tree,
from /proc) and peak resident memory sampled during the window.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import ssl
import time
from dataclasses import dataclass, field

import orjson

from proxy.tools.bench.client import Client, Exchange, build_request
from proxy.tools.bench.targets import Target, tree_cpu, tree_rss

__all__ = ["Scenario", "Window", "measure", "request_body"]

REQUEST_TIMEOUT = 60.0
SAMPLE_EVERY = 0.05  # seconds between RSS samples


@dataclass(frozen=True)
class Scenario:
    key: str  # "a", "b256", "c"
    title: str
    clients: int
    duration: float  # seconds during which clients start new requests (the last ones then finish)
    stream: bool
    delay_ms: int
    tokens: int = 100
    requests: int | None = None  # instead of the duration: this many in all (b: two waves at full concurrency)
    one_client: bool = False  # one client alone: what the proxy adds to one request's latency, in µs
    void_on_failure: bool = False  # OnTheBench's rule: a failure in a window voids its CPU figure


@dataclass
class Window:
    """One scenario against one target, once."""

    wall: float = 0.0
    ok: int = 0
    failed: int = 0
    events: int = 0
    ttft: list[float] = field(default_factory=list)
    ttfe: list[float] = field(default_factory=list)
    ttfb: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)  # the whole answer, to its last byte
    errors: list[str] = field(default_factory=list)
    cpu: float | None = None  # the target's CPU seconds over the window
    rss_idle: int | None = None
    rss_peak: int | None = None
    upstream_cpu: float | None = None
    client_cpu: float = 0.0


def request_body(model: str, scenario: Scenario) -> bytes:
    body: dict[str, object] = {
        "model": f"{model}-{scenario.delay_ms}ms" if model == "fast" else model,
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": scenario.tokens,
        "stream": scenario.stream,
    }
    if scenario.stream:
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


def _note(window: Window, exchange: Exchange) -> None:
    if exchange.error is not None or exchange.status != 200 or not exchange.done:
        window.failed += 1
        window.errors.append(exchange.error or f"status {exchange.status}")
        return
    window.ok += 1
    window.events += exchange.events
    for values, value in ((window.ttft, exchange.ttft), (window.ttfe, exchange.ttfe), (window.ttfb, exchange.ttfb),
                          (window.total, exchange.total)):  # fmt: skip
        if value is not None:
            values.append(value)


async def _sample_rss(pid: int, window: Window, stop: asyncio.Event) -> None:
    while not stop.is_set():
        rss = tree_rss(pid)
        if rss is not None:
            window.rss_peak = max(window.rss_peak or 0, rss)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_EVERY)


async def measure(target: Target, scenario: Scenario, model: str, upstream_pid: int | None,
                  requests: int | None = None) -> Window:  # fmt: skip
    """Run `scenario` against `target`, its clients in parallel, for its duration (or for `requests`
    requests in all, for a warm-up). The same duration for every target keeps the windows comparable."""
    url = target.url
    assert url.host is not None
    assert url.port is not None
    request = build_request(f"{url.host}:{url.port}", "/v1/chat/completions", request_body(model, scenario))
    tls = ssl.create_default_context() if url.scheme == "https" else None
    window = Window()
    requests = requests or scenario.requests
    remaining = iter(range(requests if requests is not None else 2**62))
    clients = [Client(url.host, url.port, tls) for _ in range(min(scenario.clients, requests or scenario.clients))]
    deadline = time.perf_counter() + scenario.duration if requests is None else math.inf

    async def worker(client: Client) -> None:
        try:
            for _ in remaining:
                if time.perf_counter() >= deadline:
                    break
                try:
                    exchange = await client.send(request, REQUEST_TIMEOUT)
                except OSError as exc:
                    exchange = Exchange(error=f"connect: {exc}")
                _note(window, exchange)
        finally:
            client.close()

    stop = asyncio.Event()
    sampler = None
    if target.pid is not None:
        window.rss_idle = tree_rss(target.pid)
        sampler = asyncio.ensure_future(_sample_rss(target.pid, window, stop))
    cpu_before = tree_cpu(target.pid) if target.pid is not None else None
    upstream_before = tree_cpu(upstream_pid) if upstream_pid is not None else None
    client_before = _own_cpu()
    start = time.perf_counter()
    try:
        async with asyncio.TaskGroup() as group:
            for client in clients:
                group.create_task(worker(client))
    finally:
        window.wall = time.perf_counter() - start
        window.client_cpu = _own_cpu() - client_before
        stop.set()
        if sampler is not None:
            await sampler
    if target.pid is not None and cpu_before is not None:
        after = tree_cpu(target.pid)
        window.cpu = None if after is None else after - cpu_before
    if upstream_pid is not None and upstream_before is not None:
        after = tree_cpu(upstream_pid)
        window.upstream_cpu = None if after is None else after - upstream_before
    return window


def _own_cpu() -> float:
    return time.process_time()
