"""The admin port: /metrics, /healthz, /readyz. Kept off the main port so every path there is the
upstream's (a backend's own /metrics or /health stays reachable through the proxy)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from .metrics import CONTENT_TYPE_LATEST
from .state import ProxyState

__all__ = ["PROBE_CACHE_SECONDS", "PROBE_TIMEOUT_SECONDS", "UpstreamProbe", "build_admin_app"]

PROBE_TIMEOUT_SECONDS = 2.0
PROBE_CACHE_SECONDS = 2.0


class UpstreamProbe:
    """`GET <upstream><health-path>`: up when it answers below 500 within 2 s; cached for 2 s."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self._checked_at = -PROBE_CACHE_SECONDS
        self._up = False
        self._lock = asyncio.Lock()

    async def is_up(self) -> bool:
        async with self._lock:  # one probe at a time; callers during it share its answer
            if time.monotonic() - self._checked_at >= PROBE_CACHE_SECONDS:
                self._up = await self._probe()
                self._checked_at = time.monotonic()
                self.state.metrics.upstream_up.set(1 if self._up else 0)
            return self._up

    async def _probe(self) -> bool:
        cfg = self.state.config
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_SECONDS)
        try:
            state = self.state
            headers = {"Authorization": state.upstream_authorization} if state.upstream_authorization else None
            async with state.upstream_session.get(
                state.upstream_base + cfg.health_path, timeout=timeout, allow_redirects=False, headers=headers
            ) as resp:
                return resp.status < 500
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False


PROBE: web.AppKey[UpstreamProbe] = web.AppKey("streamwarden_probe", UpstreamProbe)
ADMIN_STATE: web.AppKey[ProxyState] = web.AppKey("streamwarden_admin_state", ProxyState)


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    state = request.app[ADMIN_STATE]
    up = await request.app[PROBE].is_up()
    if state.draining:
        return web.json_response({"status": "draining", "upstream_up": up}, status=503)
    if not up:
        return web.json_response({"status": "upstream unavailable", "upstream_up": False}, status=503)
    return web.json_response({"status": "ready", "upstream_up": True})


async def _metrics(request: web.Request) -> web.Response:
    await request.app[PROBE].is_up()
    body = request.app[ADMIN_STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_admin_app(state: ProxyState) -> web.Application:
    app = web.Application()
    app[ADMIN_STATE] = state
    app[PROBE] = UpstreamProbe(state)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    return app
