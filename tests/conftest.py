"""Shared fixtures: real servers on loopback (the fake upstream, the proxy, its admin port).

The handles they return and the helpers tests import live in `tests/support/`.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from support import AiohttpServer, FakeUpstream, Proxy, ProxyFactory, ServeUpstream
from support.cut_relay import CutRelay
from support.hostile import RawUpstream

from proxy.config import Config
from proxy.observe.logs import make_logger
from proxy.server.app import build_state
from proxy.server.serve import Server
from proxy.tools.fake import RECORDER, FakeSettings, build_app


@pytest.fixture
async def fake_upstream(aiohttp_server: AiohttpServer) -> FakeUpstream:
    app = build_app(FakeSettings())
    server = await aiohttp_server(app)  # aiohttp's TestServer already runs with handler_cancellation=True
    return FakeUpstream(server, app[RECORDER])


@pytest.fixture
def serve_upstream(aiohttp_server: AiohttpServer) -> ServeUpstream:
    """Serve one handler on every method and path, as a hand-made upstream; returns its base URL."""

    async def start(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        server = await aiohttp_server(app)
        return str(server.make_url("")).rstrip("/")

    return start


@pytest.fixture
async def make_proxy(fake_upstream: FakeUpstream) -> AsyncIterator[ProxyFactory]:
    """Start a real proxy (main + admin ports, the `serve` server) in front of the fake upstream."""
    started: list[Server] = []

    async def start(**overrides: Any) -> Proxy:
        # --health-interval 0 unless a test asks for it: no probe at start or while idle, so what reaches a
        # test's upstream is only what the test sent (tests/loopback/test_upstream_state_log.py turns it on)
        config = Config(
            upstream=overrides.pop("upstream", fake_upstream.url), host="127.0.0.1", port=0, admin_port=0,
            health_interval=0.0,
        )
        config = dataclasses.replace(config, **overrides)
        log = io.StringIO()
        state = build_state(config, logger=make_logger("json", "debug", log))
        server = Server(config, state)
        await server.start()
        started.append(server)
        port, admin_port = server.ports()
        return Proxy(server, state, log, "127.0.0.1", port, admin_port)

    yield start
    for server in started:
        server.request_stop()
        server.request_stop()  # a second signal: no drain wait
        await server.shutdown()


@pytest.fixture
async def proxy(make_proxy: ProxyFactory) -> Proxy:
    return await make_proxy()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


@pytest.fixture
async def raw_upstreams() -> AsyncIterator[list[RawUpstream]]:
    """The raw-socket upstreams a test starts (it appends them), closed after it."""
    started: list[RawUpstream] = []
    yield started
    for upstream in started:
        await upstream.close()


@pytest.fixture
async def relays() -> AsyncIterator[list[CutRelay]]:
    """The cut relays a test starts (it appends them), stopped after it: the loopback and real resume tiers."""
    started: list[CutRelay] = []
    yield started
    for relay in started:
        await relay.stop()
