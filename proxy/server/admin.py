"""The admin port: /metrics, /healthz, /readyz. Kept off the main port so every path there is the
upstream's (a backend's own /metrics or /health stays reachable through the proxy)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable

import aiohttp
import orjson
from aiohttp import web

from proxy.exchange.state import ProxyState
from proxy.observe.metrics import CONTENT_TYPE_LATEST

__all__ = ["PROBE_CACHE_SECONDS", "PROBE_TIMEOUT_SECONDS", "UpstreamProbe", "begin_watch", "build_admin_app"]

PROBE_TIMEOUT_SECONDS = 2.0
PROBE_CACHE_SECONDS = 2.0


MODELS_PATH = "/v1/models"
_MODELS_BODY_MAX = 1024 * 1024


def served_models(body: bytes) -> list[str] | None:
    """The model ids of an OpenAI `/v1/models` answer; None when it is not one."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, list):
        return None
    return [item["id"] for item in data if isinstance(item, dict) and isinstance(item.get("id"), str)]


async def _bounded_body(resp: aiohttp.ClientResponse) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size < _MODELS_BODY_MAX:
        chunk = await resp.content.readany()
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


class UpstreamProbe:
    """`GET <upstream><health-path>`: up when it answers below 500 within 2 s; cached for 2 s.

    The same probe learns the upstream's model names (from `/v1/models`), so that those keep their
    own metric label whatever names clients send.
    """

    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self._checked_at = -PROBE_CACHE_SECONDS
        self._up = False
        self._known: bool | None = None  # the state last logged; None before the first probe
        self._lock = asyncio.Lock()
        self._probes = 0  # probes begun: a caller that waited for the lock during one shares its answer
        self.watching: asyncio.Task[None] | None = None  # `begin_watch`'s

    async def is_up(self, max_age: float | None = None) -> bool:
        """Up or not, probing when the last answer is older than ``max_age``. Asked (/readyz, /metrics:
        no ``max_age``), an up answer is kept PROBE_CACHE_SECONDS and a down one not at all: an upstream
        that came up after the probe at start is ready at the next ask, not 2 s later."""
        asked = max_age is None
        max_age = PROBE_CACHE_SECONDS if max_age is None else max_age
        probes = self._probes
        async with self._lock:  # one probe at a time; callers during it share its answer
            shared = self._probes != probes
            stale = time.monotonic() - self._checked_at >= max_age or (asked and not self._up)
            if stale and not shared:
                self._probes += 1
                self._up, cause = await self._probe()
                self._checked_at = time.monotonic()
                self.state.metrics.upstream_up.set(1 if self._up else 0)
                self._log_transition(cause)
            return self._up

    async def watch(self, interval: float) -> None:
        """Probe at once (a dead upstream is logged at start, not at the first request), then whenever no
        probe ran for ``interval`` seconds (/readyz and /metrics probe too); 0: never (only when asked)."""
        while interval > 0:
            await self.is_up(max_age=interval)
            await asyncio.sleep(max(0.0, self._checked_at + interval - time.monotonic()))

    def _log_transition(self, cause: str) -> None:
        """One line per change of the upstream's state, at warning (so `--log-level warning` keeps it):
        a dead or wrong upstream is otherwise seen only as a pod going NotReady. The first probe logs
        only a down upstream; an up one is the normal start."""
        if self._up == self._known or (self._known is None and self._up):
            self._known = self._up
            return
        came_back = self._known is False
        self._known = self._up
        upstream, path = self.state.config.redacted_upstream(), self.state.config.health_path
        if self._up:
            self.state.books.logger.warning("upstream_up", upstream=upstream, health_path=path, came_back=came_back)
        else:
            self.state.books.logger.warning("upstream_down", upstream=upstream, health_path=path, cause=cause)

    async def _probe(self) -> tuple[bool, str]:
        """(up, why not when it is down)."""
        path = self.state.config.health_path
        status, body, cause = await self._get(path)
        up = status is not None and status < 500
        if status is not None and not up:
            cause = f"GET {path} answered {status}"
        if up and path != MODELS_PATH:
            status, body, _ = await self._get(MODELS_PATH)
        names = served_models(body) if status == 200 else None
        if names is not None:
            self.state.metrics.models.set_served(names)
        return up, cause

    async def _get(self, path: str) -> tuple[int | None, bytes, str]:
        """(status, up to 1 MiB of the body, ""); (None, b"", why) when the upstream did not answer in time."""
        state = self.state
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_SECONDS)
        headers = {"Authorization": state.upstream_authorization} if state.upstream_authorization else None
        try:
            async with state.upstream_session.get(
                state.upstream_base + path, timeout=timeout, allow_redirects=False, headers=headers
            ) as resp:
                return resp.status, await _bounded_body(resp) if resp.status == 200 else b"", ""
        except TimeoutError:
            return None, b"", f"GET {path}: no answer within {PROBE_TIMEOUT_SECONDS:g} s"
        except (aiohttp.ClientError, OSError) as exc:
            return None, b"", f"GET {path}: {_why(exc)}"


def _why(exc: BaseException) -> str:
    """The OS error of a failed probe in one short line (no traceback, no class name when there is text)."""
    os_error = getattr(exc, "os_error", None)
    if isinstance(os_error, OSError) and os_error.errno is not None:
        text = os.strerror(os_error.errno)
    elif isinstance(exc, OSError) and exc.errno is not None:
        text = os.strerror(exc.errno)
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())[:200]


# `--workers N`: (workers ready, workers wanted), from the supervisor; absent for one process.
WorkerCount = Callable[[], tuple[int, int]]

PROBE: web.AppKey[UpstreamProbe] = web.AppKey("streamwarden_probe", UpstreamProbe)
ADMIN_STATE: web.AppKey[ProxyState] = web.AppKey("streamwarden_admin_state", ProxyState)
WORKERS: web.AppKey[WorkerCount] = web.AppKey("streamwarden_workers")


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    state = request.app[ADMIN_STATE]
    up = await request.app[PROBE].is_up()
    if state.draining:
        return web.json_response({"status": "draining", "upstream_up": up}, status=503)
    workers = request.app.get(WORKERS)
    if workers is not None:
        ready, wanted = workers()
        if ready < wanted:
            body = {"status": "workers not ready", "upstream_up": up, "workers_ready": ready, "workers": wanted}
            return web.json_response(body, status=503)
    if not up:
        return web.json_response({"status": "upstream unavailable", "upstream_up": False}, status=503)
    return web.json_response({"status": "ready", "upstream_up": True})


async def _metrics(request: web.Request) -> web.Response:
    await request.app[PROBE].is_up()
    body = request.app[ADMIN_STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def begin_watch(app: web.Application) -> None:
    """The upstream probed at start and while idle (``--health-interval``), from now on: called once the
    ports listen and the `started` line is (about to be) written, so a dead upstream's line follows it."""
    probe = app[PROBE]
    if probe.watching is None:
        interval = app[ADMIN_STATE].config.health_interval
        probe.watching = asyncio.get_running_loop().create_task(probe.watch(interval))


async def _end_watch(app: web.Application) -> None:
    """``on_cleanup`` (a plain coroutine: compiled code has no async generators): the watch stops."""
    task = app[PROBE].watching
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def build_admin_app(state: ProxyState, workers: WorkerCount | None = None) -> web.Application:
    app = web.Application()
    app[ADMIN_STATE] = state
    if workers is not None:
        app[WORKERS] = workers
    app[PROBE] = UpstreamProbe(state)
    app.on_cleanup.append(_end_watch)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    return app
