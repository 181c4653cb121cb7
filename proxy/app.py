"""Building the proxy's two aiohttp applications around one `ProxyState`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from .admin import build_admin_app
from .config import Config
from .exchange import Recorder
from .forward import handle
from .logs import make_logger
from .metrics import Metrics
from .state import STATE, ProxyState

__all__ = ["build_apps", "build_state", "open_upstream_session"]

# Below uvicorn's 5 s keep-alive, so the proxy drops an idle pooled connection before the backend
# does; otherwise a request could be sent on a socket the backend is just closing (a spurious 502).
UPSTREAM_KEEPALIVE_SECONDS = 4.0


def open_upstream_session(config: Config) -> aiohttp.ClientSession:
    """The pooled upstream client: unlimited connections by default, no cookies, no rewriting."""
    connector = aiohttp.TCPConnector(
        limit=config.upstream_max_connections,
        limit_per_host=0,
        keepalive_timeout=UPSTREAM_KEEPALIVE_SECONDS,
    )
    return aiohttp.ClientSession(
        connector=connector,
        # No total timeout: aiohttp's default 300 s would cut long generations. The proxy bounds
        # the phases itself (first byte, idle); only the connect is bounded here.
        timeout=aiohttp.ClientTimeout(
            total=None, connect=config.connect_timeout, sock_connect=config.connect_timeout
        ),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        cookie_jar=aiohttp.DummyCookieJar(),
        trust_env=False,
        requote_redirect_url=False,
    )


def build_state(config: Config, *, metrics: Metrics | None = None, logger: Any = None) -> ProxyState:
    metrics = metrics or Metrics(config.model_label_limit)
    logger = logger or make_logger(config.log_format, config.log_level)
    return ProxyState(config=config, metrics=metrics, recorder=Recorder(metrics, logger))


def build_apps(state: ProxyState) -> tuple[web.Application, web.Application]:
    """(main app, admin app). The main app owns the upstream session's lifetime."""
    app = web.Application(client_max_size=state.config.max_body_size)
    app[STATE] = state

    async def upstream_session(_: web.Application) -> AsyncIterator[None]:
        state.session = open_upstream_session(state.config)
        try:
            yield
        finally:
            await state.session.close()

    app.cleanup_ctx.append(upstream_session)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app, build_admin_app(state)
