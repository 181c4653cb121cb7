"""Typed application state for the proxy app: one object under one `web.AppKey`, no globals."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp

from .body_budget import BodyBudget
from .cancel_hooks import CancelHooks
from .config import Config
from .exchange import Exchange, Recorder
from .metrics import Metrics

__all__ = ["ProxyState"]


@dataclass(slots=True)
class ProxyState:
    """What every handler needs: settings, the upstream session, the books, and the drain switch."""

    config: Config
    metrics: Metrics
    recorder: Recorder
    session: aiohttp.ClientSession | None = None
    upstream_base: str = ""  # the upstream URL without credentials
    upstream_authorization: str | None = None  # from credentials in --upstream, for clients that send none
    draining: bool = False
    body_budget: BodyBudget = field(init=False)
    cancel_hooks: CancelHooks = field(init=False)  # issue 12: --cancel-hook
    live: dict[asyncio.Task[object], Exchange] = field(default_factory=dict)
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def track(self, task: asyncio.Task[object], ex: Exchange) -> None:
        self.live[task] = ex
        self.idle.clear()

    def untrack(self, task: asyncio.Task[object]) -> None:
        self.live.pop(task, None)
        if not self.live:
            self.idle.set()

    def __post_init__(self) -> None:
        self.upstream_base, self.upstream_authorization = self.config.upstream_target()
        self.body_budget = BodyBudget(self.config.max_buffered_body_bytes)
        self.cancel_hooks = CancelHooks(self.config.cancel_hook, self.upstream_base, self.upstream_authorization,
                                        self.metrics, self.recorder.logger)  # fmt: skip

    def interrupt_all(self, reason: str) -> int:
        """Ask every exchange in flight to end with `reason` (e.g. shutdown); returns how many."""
        for task, ex in list(self.live.items()):
            ex.interrupt = reason
            task.cancel()
        return len(self.live)

    @property
    def upstream_session(self) -> aiohttp.ClientSession:
        assert self.session is not None, "the proxy app is not started"
        return self.session



