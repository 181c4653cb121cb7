"""Running `serve`: both ports, and the shutdown sequence (docs/architecture.md, "Shutdown").

SIGTERM/SIGINT: /readyz turns 503 at once and the listener stops accepting; exchanges in flight run
on for up to --drain-timeout, then each is interrupted (streams end with their dialect's error
frame, reason `shutdown`, and their upstream is cancelled); then the process exits, within
--drain-timeout + 1 s. A second signal skips the wait.

A start that cannot happen (a port in use, an upstream host that does not resolve) raises
`StartupError` with one line for the operator; the command line prints it and exits 2.
The lines an operator needs at any `--log-level` (started, draining, stopped) are warnings.
"""

from __future__ import annotations

import asyncio
import errno
import signal
import socket
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from aiohttp import web
from yarl import URL

from proxy import __version__
from proxy.config import Config
from proxy.exchange.state import ProxyState
from proxy.observe.metrics import keep_values_in_memory
from proxy.server.admin import begin_watch
from proxy.server.app import (
    build_admin_app,
    build_main_server,
    build_state,
    open_upstream_pool,
    open_upstream_session,
)
from proxy.server.connections import MainPort
from proxy.server.fdlimit import connection_limit, raise_fd_limit
from proxy.server.speedups import drop_enum_lookup_hook

__all__ = ["DRAINING_HINT", "Server", "StartupError", "check_upstream", "run_loop", "serve"]

DRAINING_HINT = "Ctrl-C again to stop now"  # (or a second SIGTERM): the draining line says so

_FINAL_GRACE_SECONDS = 0.5  # after the drain deadline: time for interrupted streams to write their frame
_CLOSE_SECONDS = 0.25  # then what is left of each connection (a lingering body read) is cut
_DRAIN_MARGIN_SECONDS = 1.0  # design section 8: the process exits within --drain-timeout + 1 s
_TRACING_SHARE_SECONDS = 0.3  # of that bound, kept for the tracer's last flush
_EXIT_SECONDS = 0.7  # and for the process to exit after `stopped` (the loop's and the interpreter's teardown:
# 0.45 s measured with 100 streams just cut and a tracer thread left on a dead collector)
_MIN_TRACING_SECONDS = 0.1  # the tracer's flush gets at least this, even when the drain used the margin
# and at most this, even when the drain ended early (an idle proxy): a collector that answers takes the
# last spans in milliseconds, and one that never answers must not hold the exit for the rest of
# --drain-timeout (the exporter's 10 s timeout, then its retries: 10.3 s measured with a 30 s drain).
_MAX_TRACING_SECONDS = 1.0
_BACKLOG = 1024  # nginx uses 511; a burst of connects must not be refused by the kernel before the limit


class StartupError(Exception):
    """Serving cannot start; the message is the one line the operator sees (exit 2)."""


def listen_error(exc: OSError, host: str, port: int, flag: str) -> StartupError:
    """`OSError` of a bind, as one line naming the address and the flag that chose it."""
    what = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return StartupError(f"cannot listen on {address} ({flag}): {what}")


def check_upstream(config: Config) -> None:
    """The upstream's host must resolve (an IP address always does): a typo stops the start, as in nginx.

    A host that resolves but does not answer yet is normal (a backend loading its model): /readyz
    says 503 until it answers.
    """
    url = URL(config.upstream)
    try:
        socket.getaddrinfo(url.host, url.port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise StartupError(f"cannot resolve the --upstream host {url.host!r}: {why}") from None


class Server:
    """Both servers on their ports; `start`, then `shutdown` (or `run` for the whole life).

    A worker of `--workers N` (proxy/workers/worker.py) runs one without the admin port (the supervisor serves
    it for the whole set) and binds the main port with SO_REUSEPORT, which the other workers share.
    """

    def __init__(
        self, config: Config, state: ProxyState | None = None, *, max_connections: int | None = None,
        admin: bool = True, reuse_port: bool = False,
    ):
        self.config = config
        self.state = state or build_state(config)
        self.max_connections = max_connections or config.max_client_connections
        self.main_server: MainPort | None = None
        self.admin_app = build_admin_app(self.state)
        self._main: asyncio.Server | None = None
        self._admin = (
            web.AppRunner(self.admin_app, access_log=None, shutdown_timeout=_CLOSE_SECONDS) if admin else None
        )
        self._reuse_port = reuse_port
        self._sites: list[web.TCPSite] = []
        self._stop = asyncio.Event()
        self._hurry = asyncio.Event()
        self._shut_down = False

    @property
    def logger(self) -> Any:
        return self.state.books.logger

    async def start(self) -> None:
        cfg = self.config
        self.state.session = open_upstream_session(cfg)
        self.state.pool = open_upstream_pool(self.state)
        self.main_server = build_main_server(self.state, self.max_connections)
        loop = self.state.loop = asyncio.get_running_loop()
        try:
            try:
                self._main = await loop.create_server(
                    self.main_server, cfg.host, cfg.port, reuse_address=True, reuse_port=self._reuse_port or None,
                    backlog=_BACKLOG,
                )
            except OSError as exc:
                raise listen_error(exc, cfg.host, cfg.port, "--port") from None
            if self._admin is not None:
                await self._admin.setup()
                admin = web.TCPSite(self._admin, cfg.admin_listen_host, cfg.admin_port, reuse_address=True)
                try:
                    await admin.start()
                except OSError as exc:
                    raise listen_error(exc, cfg.admin_listen_host, cfg.admin_port, "--admin-port") from None
                self._sites.append(admin)
        except StartupError:
            await self._close_after_failed_start()
            raise
        hold = getattr(self.logger, "hold_lines", None)
        if hold is not None:  # `proxy.observe.logs.Logger`: the lines of one loop turn in one write
            hold(loop)
        if self._admin is not None:
            begin_watch(self.admin_app)  # its first probe runs after `run`'s started line

    async def _close_after_failed_start(self) -> None:
        """What `start` opened before it failed, closed, so nothing warns about it at exit."""
        if self._main is not None:
            self._main.close()
            await self._main.wait_closed()
        if self._admin is not None:
            await self._admin.cleanup()
        if self.state.session is not None:
            await self.state.session.close()

    def ports(self) -> tuple[int, int]:
        """The bound (main, admin) ports, useful when configured as 0."""
        main, admin = self._main_port(), _bound_port(self._admin)
        assert main is not None
        assert admin is not None
        return main, admin

    def request_stop(self) -> None:
        if self._stop.is_set():
            self._hurry.set()
        self._stop.set()

    async def shutdown(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        state = self.state
        state.draining = True
        loop = asyncio.get_running_loop()
        bound = loop.time() + self.config.drain_timeout + _DRAIN_MARGIN_SECONDS  # the whole shutdown's
        if self._main is not None:
            self._main.close()  # stop accepting on the main port; admin keeps answering 503
        await self._until_idle_or_hurried(self.config.drain_timeout)
        reserve = _EXIT_SECONDS + _TRACING_SHARE_SECONDS  # kept to the end of the bound, for what follows

        def within(share: float) -> float:
            """A step after the drain gets its share, but never past the whole shutdown's bound."""
            return max(0.0, min(share, bound - reserve - loop.time()))

        interrupted = state.interrupt_all()
        if interrupted:
            self.logger.warning("shutdown", interrupted=interrupted)
            await self._until_idle_or_hurried(within(_FINAL_GRACE_SECONDS))
        if self.main_server is not None:
            await self.main_server.close(within(_CLOSE_SECONDS) / 2)  # (it waits twice: before the cut, after)
        if self._admin is not None:
            await self._admin.cleanup()
        await state.background.close()  # drains still reading write their books now
        if state.pool is not None:
            state.pool.close()
        # --cancel-hook calls still in flight (those of interrupted exchanges too) run until the drain's
        # end, leaving the tracer its share of it, then are cut.
        await state.cancel_hooks.close(bound - _EXIT_SECONDS - _TRACING_SHARE_SECONDS - loop.time())
        if state.session is not None:
            await state.session.close()
        if state.books.tracing is not None:  # the last spans (the interrupted exchanges') go out, bounded
            left = max(_MIN_TRACING_SECONDS, min(_MAX_TRACING_SECONDS, bound - _EXIT_SECONDS - loop.time()))
            await asyncio.to_thread(state.books.tracing.close, left)
        self._release_lines()

    def _release_lines(self) -> None:
        release = getattr(self.logger, "release_lines", None)
        if release is not None:
            release()

    def _main_port(self) -> int | None:
        # Read as a Sequence: uvloop's `Server.sockets` is a list where typeshed says tuple, and a compiled
        # build would check the tuple.
        sockets: Sequence[socket.socket] = getattr(self._main, "sockets", ())
        return int(sockets[0].getsockname()[1]) if sockets else None

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

    async def run(self, fd_limits: tuple[int, int] | None = None, on_started: Callable[[], None] | None = None) -> None:
        loop = asyncio.get_running_loop()
        await self.start()
        try:
            await self._run(loop, fd_limits, on_started)
        finally:
            self._release_lines()  # (no held line is lost when the loop stops on an error)

    async def _run(
        self, loop: asyncio.AbstractEventLoop, fd_limits: tuple[int, int] | None, on_started: Callable[[], None] | None
    ) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        main_port, admin_port = self._main_port(), _bound_port(self._admin)
        self.logger.warning(
            "started",
            version=__version__,
            upstream=self.config.redacted_upstream(),
            listen=f"{self.config.host}:{main_port}",
            admin=f"{self.config.admin_listen_host}:{admin_port}" if admin_port is not None else None,
            nofile_soft_before=fd_limits[0] if fd_limits else None,
            nofile=fd_limits[1] if fd_limits else None,
            max_client_connections=self.max_connections,
        )
        # every setting, at debug: the started line stays short enough to read in a terminal
        self.logger.debug("settings", settings={k: v for k, v in _settings(self.config).items() if k != "upstream"})
        if self.max_connections < self.config.max_client_connections:
            self.logger.warning(
                "max_client_connections_lowered",
                configured=self.config.max_client_connections,
                effective=self.max_connections,
                why="the file-descriptor limit leaves room for this many (two sockets each)",
            )
        if on_started is not None:
            on_started()
        await self._stop.wait()
        self.logger.warning(
            "draining", in_flight=len(self.state.live), drain_timeout=self.config.drain_timeout, hint=DRAINING_HINT,
        )
        await self.shutdown()
        self.logger.warning("stopped")


def _bound_port(runner: web.BaseRunner | None) -> int | None:
    addresses = runner.addresses if runner is not None else None
    return int(addresses[0][1]) if addresses else None


def _settings(config: Config) -> dict[str, object]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def serve(config: Config) -> None:
    """One process (no `--workers`): never reads or writes an inherited multiprocess metrics directory."""
    check_upstream(config)
    ignored = keep_values_in_memory()
    limits = raise_fd_limit()
    max_connections = connection_limit(config.max_client_connections, limits[1])

    async def main() -> None:
        server = Server(config, max_connections=max_connections)
        if ignored:
            server.logger.warning("metrics_dir_ignored", path=ignored,
                                  why="one process keeps its metrics in memory; --workers N makes its own directory")
        await server.run(limits)

    run_loop(main())


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """uvloop when it is installed (the `speed` extra), else asyncio's own loop."""
    drop_enum_lookup_hook()
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)
