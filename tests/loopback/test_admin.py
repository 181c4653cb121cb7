"""The admin port: liveness, readiness against the upstream, and the metrics page."""

from __future__ import annotations

import aiohttp
from support import Proxy, ProxyFactory
from support.ports import free_port


async def test_ready_when_the_upstream_answers(proxy: Proxy, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{proxy.admin_url}/healthz") as resp:
        assert resp.status == 200
    async with http.get(f"{proxy.admin_url}/readyz") as resp:
        assert resp.status == 200
        assert (await resp.json())["upstream_up"] is True


async def test_not_ready_when_the_upstream_is_down(make_proxy: ProxyFactory, http: aiohttp.ClientSession) -> None:
    proxy = await make_proxy(upstream=f"http://127.0.0.1:{free_port()}")
    async with http.get(f"{proxy.admin_url}/healthz") as resp:
        assert resp.status == 200  # the process lives; only readiness depends on the upstream
    async with http.get(f"{proxy.admin_url}/readyz") as resp:
        assert resp.status == 503
        assert (await resp.json())["upstream_up"] is False
    assert proxy.sample("streamwarden_upstream_up") == 0


async def test_not_ready_while_draining(proxy: Proxy, http: aiohttp.ClientSession) -> None:
    proxy.state.draining = True
    async with http.get(f"{proxy.admin_url}/readyz") as resp:
        assert resp.status == 503
        assert (await resp.json())["status"] == "draining"


async def test_a_request_while_draining_gets_a_503_it_can_retry(proxy: Proxy, http: aiohttp.ClientSession) -> None:
    """A new request on a connection that was already open when the drain began."""
    proxy.state.draining = True
    async with http.post(f"{proxy.url}/v1/messages", json={"model": "m", "max_tokens": 5, "messages": []}) as resp:
        assert resp.status == 503
        assert resp.headers.get("Connection", "").lower() == "close"
        body = await resp.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "overloaded_error"
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"]) == ("error", "shutdown")


async def test_the_probe_uses_the_health_path(make_proxy: ProxyFactory, http: aiohttp.ClientSession) -> None:
    proxy = await make_proxy(health_path="/no/such/path/but/below/500")
    async with http.get(f"{proxy.admin_url}/readyz") as resp:
        assert resp.status == 200  # a 404 still proves the upstream answers


async def test_metrics_page_is_prometheus_text(proxy: Proxy, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{proxy.admin_url}/metrics") as resp:
        assert resp.status == 200
        assert resp.content_type == "text/plain"
        text = await resp.text()
    assert "# TYPE streamwarden_requests_total counter" in text
    assert "streamwarden_upstream_up 1.0" in text


async def test_main_port_has_no_endpoints_of_its_own(proxy: Proxy, http: aiohttp.ClientSession) -> None:
    """The backend's own /metrics and /health stay reachable through the proxy."""
    async with http.get(f"{proxy.url}/health") as resp:
        assert resp.status == 200
    async with http.get(f"{proxy.url}/metrics") as resp:
        assert "streamwarden_" not in await resp.text()
