"""Building the proxy's two servers around one `ProxyState`: the main port's and the admin app."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import aiohttp

from proxy.config import Config
from proxy.exchange.state import ProxyState
from proxy.observe.books import Books
from proxy.observe.logs import make_logger
from proxy.observe.metrics import Metrics
from proxy.server.admin import build_admin_app
from proxy.server.connections import ConnectionRules, ProxyServer, make_handler
from proxy.server.upstream_pool import GuardedConnector

if TYPE_CHECKING:
    from proxy.observe.tracing import Tracing

__all__ = ["LINGERING_SECONDS", "build_admin_app", "build_main_server", "build_state", "open_upstream_session"]

# Below uvicorn's 5 s keep-alive, so the proxy drops an idle pooled connection before the backend
# does; otherwise a request could be sent on a socket the backend is just closing (a spurious 502).
UPSTREAM_KEEPALIVE_SECONDS = 4.0
# How long aiohttp reads and discards a request body the handler left unread (nginx: lingering_timeout 5 s).
LINGERING_SECONDS = 5.0


def open_upstream_session(config: Config) -> aiohttp.ClientSession:
    """The pooled upstream client: unlimited connections by default, no cookies, no rewriting."""
    connector = GuardedConnector(
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


def build_main_server(state: ProxyState, max_connections: int | None = None) -> ProxyServer:
    """The main port: aiohttp's low-level server (every method and path goes to one handler)."""
    cfg = state.config
    rules = ConnectionRules(
        header_timeout=cfg.client_header_timeout,
        max_header_size=cfg.max_header_size,
        max_connections=max_connections or cfg.max_client_connections,
    )
    return ProxyServer(
        make_handler(state),
        rules=rules,
        books=state.books,
        handler_cancellation=True,  # a client that leaves cancels its handler, which cancels the upstream
        access_log=None,
        keepalive_timeout=cfg.client_keepalive_timeout,
        # The total head is bounded by --max-header-size; one line may use all of it.
        max_line_size=cfg.max_header_size,
        max_field_size=cfg.max_header_size,
        lingering_time=LINGERING_SECONDS,
        auto_decompress=False,  # request bodies go upstream byte for byte, compressed or not
    )
