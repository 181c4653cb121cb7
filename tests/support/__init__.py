"""Helpers the tests share: handles on the servers the fixtures start, and a bounded poll.

A plain importable module (not `conftest.py`), so a bare `pytest` against an installed, non-editable
`streamwarden` collects: `pyproject.toml` puts `tests/` on `sys.path` and tests `import support`.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.exchange.state import ProxyState
from proxy.server.serve import Server
from proxy.tools.fake import Recorder

__all__ = ["WAIT", "AiohttpServer", "FakeUpstream", "Proxy", "ProxyFactory", "ServeUpstream", "paused_stream", "until"]

AiohttpServer = Callable[..., Awaitable[TestServer]]

# The bound of a wait for something that happens (a log line, a close, a reply): only a bug, or a machine
# far busier than any CI, gets near it. Waits for something that must NOT happen stay short: they cost
# their whole length on every run.
WAIT = 20.0


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

    async def settled(self, within: float = WAIT) -> list[dict[str, Any]]:
        """Wait until no exchange is in flight (their log lines are then written); return the lines."""
        async with asyncio.timeout(within):
            await self.state.idle.wait()
        self.state.books.logger.write_held()  # (the last turn's lines, held until its end)
        return self.log_lines()

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.state.metrics.registry.get_sample_value(name, labels or {})
        return value or 0.0


async def until(predicate: Callable[[], bool], within: float = WAIT) -> None:
    """Poll state that no event announces (another process, the kernel's fd table), bounded."""
    async with asyncio.timeout(within):
        while not predicate():  # noqa: ASYNC110 - nothing to wait on but the state itself
            await asyncio.sleep(0.01)


ProxyFactory = Callable[..., Awaitable[Proxy]]
ServeUpstream = Callable[[Callable[[web.Request], Awaitable[web.StreamResponse]]], Awaitable[str]]


def paused_stream(first: bytes, go_on: asyncio.Event) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An upstream handler that streams `first`, then waits for `go_on` before it finishes the chat stream:
    the test acts (or lets time pass) while the proxy has relayed only the first event."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(first)
        await asyncio.wait_for(go_on.wait(), 10)
        await resp.write(b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
        return resp

    return handler
