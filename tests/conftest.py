"""Shared fixtures: real servers on loopback (the fake upstream, the proxy, its admin port)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.app import build_state
from proxy.config import Config
from proxy.fake import RECORDER, FakeSettings, Recorder, build_app
from proxy.logs import make_logger
from proxy.server import Server
from proxy.state import ProxyState

AiohttpServer = Callable[..., Awaitable[TestServer]]


@dataclass
class FakeUpstream:
    server: TestServer
    recorder: Recorder

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")


@dataclass
class Proxy:
    server: Server
    state: ProxyState
    log: io.StringIO
    host: str
    port: int
    admin_port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.host}:{self.admin_port}"

    def log_lines(self, event: str = "request") -> list[dict[str, Any]]:
        lines = [orjson.loads(line) for line in self.log.getvalue().splitlines() if line.strip()]
        return [line for line in lines if line.get("event") == event]

    async def line_for(self, request_id: str) -> dict[str, Any]:
        """The one `request` log line of `request_id`, written as its handler unwinds."""
        await until(lambda: any(line["request_id"] == request_id for line in self.log_lines()))
        lines = [line for line in self.log_lines() if line["request_id"] == request_id]
        assert len(lines) == 1, lines
        return lines[0]

    async def settled(self, within: float = 10.0) -> list[dict[str, Any]]:
        """Wait until no exchange is in flight (their log lines are then written); return the lines."""
        async with asyncio.timeout(within):
            await self.state.idle.wait()
        return self.log_lines()

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.state.metrics.registry.get_sample_value(name, labels or {})
        return value or 0.0


async def until(predicate: Callable[[], bool], within: float = 5.0) -> None:
    """Poll state that no event announces (another process, the kernel's fd table), bounded."""
    async with asyncio.timeout(within):
        while not predicate():  # noqa: ASYNC110 - nothing to wait on but the state itself
            await asyncio.sleep(0.01)


@pytest.fixture
async def fake_upstream(aiohttp_server: AiohttpServer) -> FakeUpstream:
    app = build_app(FakeSettings())
    server = await aiohttp_server(app)  # aiohttp's TestServer already runs with handler_cancellation=True
    return FakeUpstream(server, app[RECORDER])


ProxyFactory = Callable[..., Awaitable[Proxy]]
ServeUpstream = Callable[[Callable[[web.Request], Awaitable[web.StreamResponse]]], Awaitable[str]]


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
        config = Config(upstream=overrides.pop("upstream", fake_upstream.url), host="127.0.0.1", port=0, admin_port=0)
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


