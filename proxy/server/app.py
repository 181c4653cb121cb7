"""Building the proxy's two servers around one `ProxyState`: the main port's and the admin app."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import aiohttp

from proxy.config import Config
from proxy.exchange.handler import handle
from proxy.exchange.state import ProxyState
from proxy.observe.books import Books
from proxy.observe.logs import make_logger
from proxy.observe.metrics import Metrics
from proxy.server.admin import build_admin_app
from proxy.server.connections import ConnectionRules, MainPort
from proxy.server.upstream_pool import UPSTREAM_KEEPALIVE_SECONDS, ConnectionPool

if TYPE_CHECKING:
    from proxy.observe.tracing import Tracing

__all__ = [
    "build_admin_app", "build_main_server", "build_state", "open_upstream_pool",
    "open_upstream_session",
]

def open_upstream_pool(state: ProxyState) -> ConnectionPool:
    """The exchanges' upstream connections (proxy/server/upstream_pool.py)."""
    cfg = state.config
    return ConnectionPool(state.upstream_base, limit=cfg.upstream_max_connections, connect_timeout=cfg.connect_timeout)


def open_upstream_session(config: Config) -> aiohttp.ClientSession:
    """The admin port's health check and the --cancel-hook calls: no cookies, no rewriting."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_SECONDS),
        timeout=aiohttp.ClientTimeout(
            total=None, connect=config.connect_timeout, sock_connect=config.connect_timeout
        ),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        cookie_jar=aiohttp.DummyCookieJar(),
        trust_env=False,
        requote_redirect_url=False,
    )


def open_tracing(config: Config, logger: Any = None) -> Tracing | None:
    """OpenTelemetry traces when an OTLP endpoint is set (the SDK is imported only then)."""
    if config.otlp_endpoint is None:
        return None
    from proxy.observe.tracing import Tracing

    return Tracing(config.otlp_endpoint, logger=logger)


def build_state(config: Config, *, metrics: Metrics | None = None, logger: Any = None) -> ProxyState:
    metrics = metrics or Metrics(config.model_label_limit)
    logger = logger or make_logger(config.log_format, config.log_level)
    return ProxyState(config=config, metrics=metrics, books=Books(metrics, logger, open_tracing(config, logger)))


def build_main_server(state: ProxyState, max_connections: int | None = None) -> MainPort:
    """The main port: every method and path goes to one exchange (proxy/exchange/handler.py)."""
    cfg = state.config
    rules = ConnectionRules(
        header_timeout=cfg.client_header_timeout,
        max_header_size=cfg.max_header_size,
        max_connections=max_connections or cfg.max_client_connections,
        keepalive_timeout=cfg.client_keepalive_timeout,
    )

    return MainPort(partial(handle, state=state), rules=rules, books=state.books)  # (no coroutine layer between)
