"""The upstream's state in the logs: /readyz's probe logs the upstream going down and coming
back, once per transition, at warning, with the cause; a request that cannot reach the upstream says
why in its own log line.

The probe's 2 s cache is set to 0 here so that every /readyz probes again: no test waits for it.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from support import WAIT, ProxyFactory, ServeUpstream, until
from support.ports import free_port

from proxy.server import admin

pytestmark = pytest.mark.asyncio


@pytest.fixture(autouse=True)
def no_probe_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admin, "PROBE_CACHE_SECONDS", 0.0)


async def readyz(admin_url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(admin_url + "/readyz") as resp:
        return resp.status


async def test_down_and_back_are_logged_once_per_transition_at_warning(
    make_proxy: ProxyFactory, serve_upstream: ServeUpstream
) -> None:
    health = {"status": 200}

    async def upstream(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []}, status=health["status"])

    proxy = await make_proxy(upstream=await serve_upstream(upstream))
    assert await readyz(proxy.admin_url) == 200
    assert proxy.log_lines(event="upstream_down") == proxy.log_lines(event="upstream_up") == []  # a normal start
    health["status"] = 503
    for _ in range(3):
        assert await readyz(proxy.admin_url) == 503
    health["status"] = 200
    for _ in range(3):
        assert await readyz(proxy.admin_url) == 200
    down, up = proxy.log_lines(event="upstream_down"), proxy.log_lines(event="upstream_up")
    assert len(down) == 1
    assert len(up) == 1
    assert down[0]["level"] == up[0]["level"] == "warning"
    assert down[0]["cause"] == "GET /v1/models answered 503"
    assert down[0]["upstream"] == proxy.state.config.upstream
    assert up[0]["came_back"] is True


async def test_an_upstream_down_from_the_start_is_logged_with_the_os_error(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(upstream=f"http://127.0.0.1:{free_port()}")
    for _ in range(2):
        assert await readyz(proxy.admin_url) == 503
    [down] = proxy.log_lines(event="upstream_down")
    assert down["level"] == "warning"
    assert down["cause"] == "GET /v1/models: Connection refused"
    assert proxy.log_lines(event="upstream_up") == []


async def test_an_upstream_down_at_start_is_logged_before_any_request_or_probe(make_proxy: ProxyFactory) -> None:
    """`make run UPSTREAM=http://127.0.0.1:9` (issue 35): the start's own probe logs the dead upstream at
    once; nothing asks /readyz and no request comes."""
    proxy = await make_proxy(upstream=f"http://127.0.0.1:{free_port()}", health_interval=10.0)  # the default
    await until(lambda: bool(proxy.log_lines(event="upstream_down")))
    [down] = proxy.log_lines(event="upstream_down")
    assert down["cause"] == "GET /v1/models: Connection refused"
    assert proxy.sample("streamwarden_upstream_up") == 0


async def test_an_idle_proxy_probes_on_the_health_interval(
    make_proxy: ProxyFactory, serve_upstream: ServeUpstream
) -> None:
    """Nothing asks /readyz and no request comes: the upstream's fall and return are logged all the same."""
    health = {"status": 200, "probes": 0}

    async def upstream(request: web.Request) -> web.Response:
        health["probes"] += 1
        return web.json_response({"object": "list", "data": []}, status=health["status"])

    proxy = await make_proxy(upstream=await serve_upstream(upstream), health_interval=0.05)
    await until(lambda: health["probes"] >= 1)  # the probe at start
    health["status"] = 503
    await until(lambda: bool(proxy.log_lines(event="upstream_down")))
    health["status"] = 200
    await until(lambda: bool(proxy.log_lines(event="upstream_up")))
    assert len(proxy.log_lines(event="upstream_down")) == 1
    [up] = proxy.log_lines(event="upstream_up")
    assert up["came_back"] is True


async def test_an_upstream_up_after_the_start_probe_is_ready_at_the_next_ask(
    make_proxy: ProxyFactory, serve_upstream: ServeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proxy starts beside its backend (a pod, `make run`): the probe at start finds it down. Once it
    answers, /readyz says ready at once: a down answer is not kept (an up one is, PROBE_CACHE_SECONDS)."""
    monkeypatch.setattr(admin, "PROBE_CACHE_SECONDS", 600.0)
    health = {"status": 503}

    async def upstream(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []}, status=health["status"])

    proxy = await make_proxy(upstream=await serve_upstream(upstream), health_interval=10.0)
    await until(lambda: bool(proxy.log_lines(event="upstream_down")))
    health["status"] = 200
    assert await readyz(proxy.admin_url) == 200
    health["status"] = 503
    assert await readyz(proxy.admin_url) == 200  # up is kept for PROBE_CACHE_SECONDS


async def test_a_zero_health_interval_probes_only_when_asked(
    make_proxy: ProxyFactory, serve_upstream: ServeUpstream
) -> None:
    probes = []

    async def upstream(request: web.Request) -> web.Response:
        probes.append(request.path)
        return web.json_response({"object": "list", "data": []})

    proxy = await make_proxy(upstream=await serve_upstream(upstream), health_interval=0.0)
    watch = proxy.server.admin_app[admin.PROBE].watching
    assert watch is not None
    await asyncio.wait_for(asyncio.shield(watch), WAIT)  # it returned at once, without a probe
    assert (watch.done(), watch.cancelled(), probes) == (True, False, [])
    assert await readyz(proxy.admin_url) == 200
    assert probes == ["/v1/models"]


async def test_a_connect_failed_request_line_says_why(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(upstream=f"http://127.0.0.1:{free_port()}")
    async with aiohttp.ClientSession() as session:
        async with session.get(proxy.url + "/v1/models", headers={"X-Request-Id": "cause-1"}) as resp:
            assert resp.status == 502
    line = await proxy.line_for("cause-1")
    assert (line["outcome"], line["reason"]) == ("error", "connect_failed")
    assert line["cause"].startswith("could not connect to the upstream: ")
    assert len(line["cause"]) <= 200
    assert "Traceback" not in line["cause"]


async def test_an_ok_request_line_has_no_cause(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    async with aiohttp.ClientSession() as session:
        async with session.get(proxy.url + "/v1/models", headers={"X-Request-Id": "cause-2"}) as resp:
            assert resp.status == 200
    assert "cause" not in await proxy.line_for("cause-2")
