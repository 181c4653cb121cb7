"""Running `serve`: both ports, and the shutdown sequence of design section 8.

SIGTERM/SIGINT: /readyz turns 503 at once and the listener stops accepting; exchanges in flight run
on for up to --drain-timeout, then each is interrupted (streams end with their dialect's error
frame, reason `shutdown`, and their upstream is cancelled); then the process exits 0. A second
signal skips the wait.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

from aiohttp import web

from . import __version__
from .app import build_apps, build_state
from .config import Config
from .state import ProxyState

__all__ = ["Server", "serve"]

_FINAL_GRACE_SECONDS = 5.0  # after the drain deadline: time for interrupted streams to write their frame


class Server:
    """Both apps on their ports; `start`, then `shutdown` (or `run` for the whole life)."""

    def __init__(self, config: Config, state: ProxyState | None = None) -> None:
        self.config = config
        self.state = state or build_state(config)
        self.main_app, self.admin_app = build_apps(self.state)
        self._main = web.AppRunner(self.main_app, handler_cancellation=True, access_log=None)
        self._admin = web.AppRunner(self.admin_app, access_log=None)
        self._sites: list[web.TCPSite] = []
        self._stop = asyncio.Event()
        self._hurry = asyncio.Event()

    @property
    def logger(self) -> Any:
        return self.state.recorder.logger

    async def start(self) -> None:
        cfg = self.config
        await self._main.setup()
        await self._admin.setup()
        main = web.TCPSite(self._main, cfg.host, cfg.port, reuse_address=True)
        admin = web.TCPSite(self._admin, cfg.host, cfg.admin_port, reuse_address=True)
        await main.start()
        await admin.start()
        self._sites = [main, admin]

    def ports(self) -> tuple[int, int]:
        """The bound (main, admin) ports, useful when configured as 0."""
        found: list[int] = []
        for runner in (self._main, self._admin):
            server = runner.server
            addresses = runner.addresses
            assert server is not None
            assert addresses
            found.append(int(addresses[0][1]))
        return found[0], found[1]

    def request_stop(self) -> None:
        if self._stop.is_set():
            self._hurry.set()
        self._stop.set()

    async def shutdown(self) -> None:
        state = self.state
        state.draining = True
        await self._sites[0].stop()  # stop accepting on the main port; admin keeps answering 503
        await self._until_idle_or_hurried(self.config.drain_timeout)
        interrupted = state.interrupt_all("shutdown")
        if interrupted:
            self.logger.info("shutdown", interrupted=interrupted)
            await self._until_idle_or_hurried(_FINAL_GRACE_SECONDS)
        await self._main.cleanup()
        await self._admin.cleanup()

    async def _until_idle_or_hurried(self, within: float) -> None:
        """Wait until no exchange is in flight, a second signal comes, or `within` seconds pass."""
        if not self.state.live or self._hurry.is_set():
            return
        waiters = {asyncio.ensure_future(self.state.idle.wait()), asyncio.ensure_future(self._hurry.wait())}
        try:
            await asyncio.wait(waiters, timeout=within, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        await self.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        main_port, admin_port = self.ports()
        self.logger.info(
            "started",
            version=__version__,
            upstream=self.config.redacted_upstream(),
            listen=f"{self.config.host}:{main_port}",
            admin=f"{self.config.host}:{admin_port}",
            settings={k: v for k, v in _settings(self.config).items() if k != "upstream"},
        )
        await self._stop.wait()
        self.logger.info("draining", in_flight=len(self.state.live), drain_timeout=self.config.drain_timeout)
        await self.shutdown()
        self.logger.info("stopped")


def _settings(config: Config) -> dict[str, object]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def serve(config: Config) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(Server(config).run())
    else:
        uvloop.run(Server(config).run())
