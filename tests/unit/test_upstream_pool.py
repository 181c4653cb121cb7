"""The upstream pool without sockets: a backend of byte scripts (in the manner of httpcore's
MockBackend) behind the loop's `create_connection`, and a clock the test moves (the idle timer)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from multidict import CIMultiDict
from support.fake_io import ClockLoop, FakeTransport, run, turns

from proxy.core.lifecycle import Reason
from proxy.exchange.errors import UpstreamFailure
from proxy.server.upstream_conn import UpstreamConnection
from proxy.server.upstream_pool import ConnectionPool

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
CLOSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"


class ScriptedTransport(FakeTransport):
    """Answers each request it is written with the next response of its script."""

    def __init__(self, loop: asyncio.AbstractEventLoop, protocol: UpstreamConnection, script: list[bytes]) -> None:
        super().__init__()
        self.loop, self.protocol, self.script = loop, protocol, script

    def write(self, data: bytes | bytearray | memoryview) -> None:
        super().write(data)
        if bytes(data).endswith(b"\r\n\r\n") and self.script:
            self.loop.call_soon(self.protocol.data_received, self.script.pop(0))

    def close(self) -> None:
        if not self.closing:
            super().close()
            self.loop.call_soon(self.protocol.connection_lost, None)


class BackendLoop(ClockLoop):
    """A clock loop whose `create_connection` hands out scripted transports."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[list[bytes]] = []
        self.connections: list[ScriptedTransport] = []
        self.refuse = False

    async def create_connection(self, factory: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        if self.refuse:
            raise ConnectionRefusedError(111, "Connection refused")
        protocol = factory()
        transport = ScriptedTransport(self, protocol, self.scripts.pop(0) if self.scripts else [])
        self.connections.append(transport)
        protocol.connection_made(transport)
        return transport, protocol


class Sink:
    def __init__(self) -> None:
        self.data = b""
        self.ended = False

    def body(self, data: bytes) -> None:
        self.data += data

    def end(self) -> None:
        self.ended = True

    def failed(self, failure: UpstreamFailure) -> None:
        raise AssertionError(failure)


async def fetch(pool: ConnectionPool) -> UpstreamConnection:
    link, head = await pool.request("GET", "/v1/models", CIMultiDict(), None)
    assert head.status == 200
    sink = Sink()
    link.attach(sink)
    await turns()
    assert sink.ended
    assert isinstance(link, UpstreamConnection)
    return link


def test_a_clean_connection_is_reused() -> None:
    async def test(loop: BackendLoop) -> None:
        loop.scripts = [[OK, OK]]
        pool = ConnectionPool("http://backend:8000", limit=0, connect_timeout=5.0)
        first = await fetch(pool)
        pool.release(first)
        second = await fetch(pool)
        assert second is first
        assert len(loop.connections) == 1

    run(test, BackendLoop)


def test_a_connection_that_said_close_is_not_reused() -> None:
    async def test(loop: BackendLoop) -> None:
        loop.scripts = [[CLOSE], [OK]]
        pool = ConnectionPool("http://backend:8000", limit=0, connect_timeout=5.0)
        first = await fetch(pool)
        pool.release(first)
        second = await fetch(pool)
        assert second is not first
        assert len(loop.connections) == 2

    run(test, BackendLoop)


def test_past_the_limit_a_request_waits_for_a_connection_to_come_free() -> None:
    async def test(loop: BackendLoop) -> None:
        loop.scripts = [[OK, OK]]
        pool = ConnectionPool("http://backend:8000", limit=1, connect_timeout=5.0)
        first = await fetch(pool)
        waiting = asyncio.ensure_future(fetch(pool))
        await turns()
        assert not waiting.done()
        pool.release(first)
        await turns(10)
        assert waiting.done()
        assert waiting.result() is first
        assert len(loop.connections) == 1

    run(test, BackendLoop)


def test_an_idle_connection_is_dropped_after_the_keepalive() -> None:
    async def test(loop: BackendLoop) -> None:
        loop.scripts = [[OK]]
        pool = ConnectionPool("http://backend:8000", limit=0, connect_timeout=5.0, keepalive=4.0)
        pool.release(await fetch(pool))
        loop.now += 3.9
        await turns()
        assert not loop.connections[0].closing
        loop.now += 0.2
        await turns()
        assert loop.connections[0].closing
        assert pool.open_connections == 0

    run(test, BackendLoop)


def test_a_reused_connection_is_dropped_a_keepalive_after_its_last_release() -> None:
    async def test(loop: BackendLoop) -> None:
        loop.scripts = [[OK, OK]]
        pool = ConnectionPool("http://backend:8000", limit=0, connect_timeout=5.0, keepalive=4.0)
        pool.release(await fetch(pool))
        loop.now += 3.0
        pool.release(await fetch(pool))  # the same connection, idle again from here
        loop.now += 1.1  # the first release's keepalive is over, not this one's
        await turns()
        assert len(loop.connections) == 1
        assert not loop.connections[0].closing
        loop.now += 2.8
        await turns()
        assert not loop.connections[0].closing
        loop.now += 0.2
        await turns()
        assert loop.connections[0].closing
        assert pool.open_connections == 0

    run(test, BackendLoop)


def test_a_refused_connect_is_connect_failed() -> None:
    async def test(loop: BackendLoop) -> None:
        loop.refuse = True
        pool = ConnectionPool("http://backend:8000", limit=1, connect_timeout=5.0)
        with pytest.raises(UpstreamFailure) as caught:
            await pool.request("GET", "/", CIMultiDict(), None)
        assert caught.value.reason is Reason.CONNECT_FAILED
        assert pool.open_connections == 0

    run(test, BackendLoop)
