"""The proxy's state, built once and passed in: config, books, the upstream pool, the body budget,
the exchanges in flight (for shutdown's interrupt), background tasks; no globals. The aiohttp
session is the admin port's (its health check of the upstream) and the cancel hooks'."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp

from proxy.config import Config
from proxy.core.record import ExchangeRecord
from proxy.exchange.body_budget import BodyBudget
from proxy.exchange.errors import Interrupter
from proxy.exchange.hooks import Background, CancelHooks
from proxy.exchange.upstream import UpstreamPool
from proxy.observe.books import Books
from proxy.observe.metrics import Metrics

__all__ = ["ProxyState"]


@dataclass(slots=True)
class ProxyState:
    """What every handler needs: settings, the upstream pool, the books, and the drain switch."""

    config: Config
    metrics: Metrics
    books: Books
    session: aiohttp.ClientSession | None = None  # the admin port's health check
    pool: UpstreamPool | None = None  # the exchanges' upstream connections
    upstream_base: str = ""  # the upstream URL without credentials
    upstream_authorization: str | None = None  # from credentials in --upstream, for clients that send none
    draining: bool = False
    body_budget: BodyBudget = field(init=False)
    live: dict[Interrupter, ExchangeRecord] = field(default_factory=dict)
    background: Background = field(default_factory=Background)  # tasks that outlive a handler (drains)
    cancel_hooks: CancelHooks = field(init=False)  # --cancel-hook
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    loop: asyncio.AbstractEventLoop = field(init=False)  # the server's (Server.start): asked for once, not per request

    def track(self, interrupter: Interrupter, ex: ExchangeRecord) -> None:
        self.live[interrupter] = ex
        self.idle.clear()

    def untrack(self, interrupter: Interrupter) -> None:
        self.live.pop(interrupter, None)
        if not self.live:
            self.idle.set()

    def __post_init__(self) -> None:
        self.upstream_base, self.upstream_authorization = self.config.upstream_target()
        self.body_budget = BodyBudget(self.config.max_buffered_body_bytes)
        self.cancel_hooks = CancelHooks(self.config.cancel_hook, self.upstream_base, self.upstream_authorization,
                                        self.metrics, self.books.logger)  # fmt: skip

    def interrupt_all(self) -> int:
        """Shutdown's drain time is over: every exchange in flight is interrupted; returns how many."""
        live = list(self.live)  # (an exchange carried in callbacks ends, and leaves `live`, as it is fired)
        for interrupter in live:
            interrupter.fire()
        return len(live)

    @property
    def upstream(self) -> UpstreamPool:
        assert self.pool is not None, "the proxy is not started"
        return self.pool

    @property
    def upstream_session(self) -> aiohttp.ClientSession:
        assert self.session is not None, "the proxy app is not started"
        return self.session



