"""`serve --workers N` (N > 1): one supervisor, N worker processes on one main port.

Each worker (proxy/workers/worker.py) binds the main port with SO_REUSEPORT, so the kernel spreads new
connections over the workers' own accept queues; the supervisor holds a bound, non-listening socket
on the port for its whole life (it resolves `--port 0` once, and no other program can take the port
between a worker's death and its replacement). The supervisor serves the one admin port:
- /metrics: prometheus_client's multiprocess mode, every process writing its values to files in a
  temporary directory the supervisor creates and removes, merged at each scrape (proxy/observe/metrics.py);
- /readyz: 200 only when every worker is up, the set is not draining and the upstream answers;
- /healthz: the supervisor lives.

A worker that dies (a crash, the OOM killer, `kill -9`) is logged and replaced, with a back-off
when replacements die young. A worker that hangs (its event loop stuck, or SIGSTOPped) keeps its
accept queue, and the kernel keeps handing it new connections: each worker writes a heartbeat line
every second from its loop, and one silent for HEARTBEAT_TIMEOUT seconds is killed and replaced
(`worker_hung`); /readyz says 503 from then until its replacement is ready.

SIGTERM/SIGINT: /readyz turns 503 and every worker gets SIGTERM and
drains as one process would, so the set exits within --drain-timeout + 1 s; a
second signal is passed on (the workers skip the rest of the wait). Workers run in their own session
so that a terminal's Ctrl-C reaches them only through the supervisor, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web
from prometheus_client import values
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from proxy import __version__
from proxy.config import Config
from proxy.observe.metrics import Metrics, ModelLabels
from proxy.server.admin import begin_watch, build_admin_app
from proxy.server.app import build_state, open_upstream_session
from proxy.server.serve import DRAINING_HINT, StartupError, listen_error
from proxy.workers.metrics_dir import MetricsDir, sweep_stale
from proxy.workers.worker import READY_LINE, WorkerBoot, encode_boot, encode_models

__all__ = ["HEARTBEAT_TIMEOUT", "Supervisor", "supervise"]

_KILL_MARGIN_SECONDS = 2.0  # past a worker's own drain bound (--drain-timeout + 1 s): SIGKILL
_FIRST_RESTART_DELAY = 0.1
_MAX_RESTART_DELAY = 10.0
_STABLE_SECONDS = 10.0  # a worker that lived this long resets the back-off
_CLOSE_SECONDS = 0.25
HEARTBEAT_TIMEOUT = 5.0  # seconds without a heartbeat (one a second) before a worker is taken for hung
WORKER_ARGV = (sys.executable, "-m", "proxy.workers.worker")


@dataclass(slots=True)
class _Slot:
    """One worker position: its index survives the processes that fill it."""

    index: int
    proc: asyncio.subprocess.Process | None = None
    ready: bool = False
    been_ready: bool = False  # once a worker of this slot came up, a death is a restart, not a start failure
    started_at: float = 0.0
    restart_delay: float = 0.0
    task: asyncio.Task[None] | None = field(default=None, repr=False)


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound, non-listening socket on (host, port): it takes no connections, only the port.

    It binds *without* SO_REUSEPORT, so that a port any other socket holds (another program, or a second
    streamwarden set whose workers would otherwise silently share it) is refused, and only then sets the
    option, which lets this set's workers join.
    """
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE,
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    except OSError:
        sock.close()
        raise
    return sock


class _ForwardedModelLabels(ModelLabels):
    """The supervisor's model labels: what its probe learns is passed on to the workers, who label."""

    def __init__(self, limit: int, on_served: Callable[[list[str]], None]) -> None:
        super().__init__(limit)
        self._on_served = on_served

    def set_served(self, names: list[str]) -> None:
        super().set_served(names)
        self._on_served(names)


class Supervisor:
    """Starts, watches, replaces and drains the workers; serves the admin port for all of them."""

    def __init__(
        self, config: Config, multiprocess_dir: str, *, worker_argv: Sequence[str] = WORKER_ARGV, logger: Any = None,
    ) -> None:
        self.config = config
        self.multiprocess_dir = multiprocess_dir
        self.worker_argv = tuple(worker_argv)
        self.heartbeat_timeout = HEARTBEAT_TIMEOUT
        metrics = Metrics(config.model_label_limit, multiprocess_dir=multiprocess_dir)
        # No tracer here: the workers' exchanges are the spans; the admin port makes none.
        self.state = build_state(replace(config, otlp_endpoint=None), metrics=metrics, logger=logger)
        self.state.session = open_upstream_session(config)
        self.slots = [_Slot(i) for i in range(config.workers)]
        self._served: tuple[str, ...] | None = None
        self._stop = asyncio.Event()
        self._reserved: socket.socket | None = None
        self._admin: web.AppRunner | None = None
        self._worker_config = config
        self._env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": multiprocess_dir}
        self._failed: str | None = None
        self._archive: dict[tuple[Any, ...], Any] = {}  # dead workers' counts, in this process's files
        self.state.metrics.models = _ForwardedModelLabels(config.model_label_limit, self._on_served_models)

    @property
    def logger(self) -> Any:
        return self.state.books.logger

    def _on_served_models(self, names: list[str]) -> None:
        """The probe learned the upstream's model names: the workers label with them too."""
        if tuple(names) != self._served:
            self._served = tuple(names)
            self._broadcast_models(names)

    def worker_count(self) -> tuple[int, int]:
        """(ready, wanted), for /readyz."""
        return sum(1 for slot in self.slots if slot.ready), len(self.slots)

    async def run(self) -> int:
        cfg = self.config
        try:
            self._reserved = reserve_port(cfg.host, cfg.port)
        except OSError as exc:
            await self._close()
            raise listen_error(exc, cfg.host, cfg.port, "--port") from None
        port = int(self._reserved.getsockname()[1])
        self._worker_config = replace(cfg, port=port)
        self._admin = web.AppRunner(
            build_admin_app(self.state, self.worker_count), access_log=None, shutdown_timeout=_CLOSE_SECONDS,
        )
        await self._admin.setup()
        admin = web.TCPSite(self._admin, cfg.admin_listen_host, cfg.admin_port, reuse_address=True)
        try:
            await admin.start()
        except OSError as exc:
            await self._close()
            raise listen_error(exc, cfg.admin_listen_host, cfg.admin_port, "--admin-port") from None
        admin_port = self._admin.addresses[0][1]
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        self.logger.warning(
            "started", version=__version__, upstream=cfg.redacted_upstream(), listen=f"{cfg.host}:{port}",
            admin=f"{cfg.admin_listen_host}:{admin_port}", workers=len(self.slots), pid=os.getpid(),
            metrics_dir=self.multiprocess_dir,
        )
        begin_watch(self._admin.app)
        try:
            for slot in self.slots:
                slot.task = asyncio.ensure_future(self._keep(slot))
            await self._stop.wait()
            if self._failed is None:
                self.logger.warning(
                    "draining", workers=len(self.slots), drain_timeout=cfg.drain_timeout, hint=DRAINING_HINT,
                )
            await self._drain()  # a second signal, meanwhile, is passed on to the workers
            await self._close()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        if self._failed is not None:
            return 1
        self.logger.warning("stopped")
        return 0

    def request_stop(self) -> None:
        """As SIGTERM does: drain every worker, then stop (a second call hurries them)."""
        self._on_signal()

    def _on_signal(self) -> None:
        self.state.draining = True
        for slot in self.slots:
            if slot.proc is not None and slot.proc.returncode is None:
                slot.proc.send_signal(signal.SIGTERM)  # the second time: the worker skips the rest of its drain
        self._stop.set()

    async def _keep(self, slot: _Slot) -> None:
        """Run the slot's worker; while not draining, replace it when it dies."""
        while not self._stop.is_set():
            await self._start(slot)
            proc = slot.proc
            assert proc is not None
            watch = asyncio.ensure_future(self._watch(slot, proc)) if slot.ready else None
            try:
                code = await proc.wait()
            finally:
                if watch is not None:
                    watch.cancel()
            slot.ready = False
            lived = time.monotonic() - slot.started_at
            self._forget(proc.pid)
            if self._stop.is_set():
                return
            if not slot.been_ready:  # the first worker of the slot never came up: no use retrying
                self._failed = f"worker {slot.index} exited with {_describe_exit(code)} before it was ready"
                self.logger.error("worker_failed", worker=slot.index, pid=proc.pid, exit=_describe_exit(code))
                self._on_signal()
                return
            slot.restart_delay = (
                _FIRST_RESTART_DELAY if lived >= _STABLE_SECONDS
                else min(_MAX_RESTART_DELAY, max(_FIRST_RESTART_DELAY, slot.restart_delay * 2))
            )
            self.logger.warning(
                "worker_exited", worker=slot.index, pid=proc.pid, exit=_describe_exit(code),
                lived_s=round(lived, 3), restart_in_s=slot.restart_delay,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), slot.restart_delay)

    async def _start(self, slot: _Slot) -> None:
        proc = await asyncio.create_subprocess_exec(
            *self.worker_argv,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=None,
            env=self._env, start_new_session=True,
        )
        slot.proc, slot.started_at = proc, time.monotonic()
        if self._stop.is_set():  # the signal came while this worker was being started: it drains too
            proc.send_signal(signal.SIGTERM)
        assert proc.stdin is not None
        assert proc.stdout is not None
        share = self._worker_config.worker_share(slot.index)  # the sidecar's bounds, split across the workers
        boot = WorkerBoot(share, slot.index, self.multiprocess_dir, self._served)
        proc.stdin.write(encode_boot(boot))
        with contextlib.suppress(ConnectionError):
            await proc.stdin.drain()
        self.logger.info("worker_started", worker=slot.index, pid=proc.pid)
        line = await proc.stdout.readline()
        if line == READY_LINE:
            slot.ready = slot.been_ready = True
            self.logger.info("worker_ready", worker=slot.index, pid=proc.pid)

    async def _watch(self, slot: _Slot, proc: asyncio.subprocess.Process) -> None:
        """Read the worker's heartbeats; kill it when they stop (its `_keep` then replaces it)."""
        assert proc.stdout is not None
        while True:
            try:
                line = await asyncio.wait_for(proc.stdout.readline(), self.heartbeat_timeout)
            except TimeoutError:
                break
            if not line:  # EOF: the worker is exiting, and proc.wait() tells how
                return
        if proc.returncode is None:
            slot.ready = False  # /readyz: 503 until the replacement is ready
            self.logger.error("worker_hung", worker=slot.index, pid=proc.pid, silent_s=self.heartbeat_timeout,
                              why="no heartbeat: its event loop is stuck or it is stopped; killed and replaced")
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    def _broadcast_models(self, names: list[str]) -> None:
        line = encode_models(names)
        for slot in self.slots:
            proc = slot.proc
            if proc is not None and proc.returncode is None and proc.stdin is not None:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    proc.stdin.write(line)

    def _forget(self, pid: int) -> None:
        """A dead worker's live gauges (in-flight) leave the sums; its counters and histograms stay, so
        none goes back, folded into the supervisor's own files: a worker that keeps dying must not
        leave a file per death for every scrape to read."""
        mark_process_dead(pid, self.multiprocess_dir)  # type: ignore[no-untyped-call]
        if not getattr(values.ValueClass, "_multiprocess", False):
            return  # this process is not writing metrics files (a test's supervisor)
        files = [os.path.join(self.multiprocess_dir, f"{kind}_{pid}.db") for kind in ("counter", "histogram")]
        files = [path for path in files if os.path.exists(path)]
        # Synchronous on the loop that also serves /metrics: no scrape sees a value both here and there.
        for metric in MultiProcessCollector.merge(files, accumulate=False):  # type: ignore[no-untyped-call]
            for sample in metric.samples:
                if not sample.value:
                    continue
                names = tuple(sample.labels)
                key = (metric.type, metric.name, sample.name, names, tuple(sample.labels[n] for n in names))
                value = self._archive.get(key)
                if value is None:
                    value = self._archive[key] = values.ValueClass(*key, metric.documentation)
                value.inc(sample.value)
        for path in files:
            os.remove(path)

    async def _drain(self) -> None:
        """Every worker drains on its own (it got SIGTERM); past its bound and a margin, it is killed."""
        tasks = [slot.task for slot in self.slots if slot.task is not None]
        bound = self.config.drain_timeout + 1.0 + _KILL_MARGIN_SECONDS
        _, pending = await asyncio.wait(tasks, timeout=bound) if tasks else (set(), set())
        for slot in self.slots:
            proc = slot.proc
            if proc is not None and proc.returncode is None:
                self.logger.error("worker_killed", worker=slot.index, pid=proc.pid, why="still running after the drain")
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        if pending:
            await asyncio.wait(pending, timeout=_KILL_MARGIN_SECONDS)
        for task in pending:
            task.cancel()

    async def _close(self) -> None:
        for slot in self.slots:
            if slot.proc is not None and slot.proc.stdin is not None:
                slot.proc.stdin.close()
        if self._admin is not None:
            await self._admin.cleanup()
        if self.state.session is not None:
            await self.state.session.close()
        if self._reserved is not None:
            self._reserved.close()


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def supervise(config: Config) -> int:
    """Make the metrics directory, switch this process's prometheus_client to multiprocess mode, run."""
    from prometheus_client import values

    from proxy.server.serve import check_upstream, run_loop

    check_upstream(config)
    stale = sweep_stale()  # left by supervisors that were killed (a /tmp emptyDir outlives restarts)
    try:
        owned = MetricsDir()
    except OSError as exc:  # FileNotFoundError when no candidate directory is writable
        why = exc.strerror or str(exc)
        raise StartupError(
            f"--workers needs a writable directory for its metrics files: {why}; "
            "set TMPDIR to one (in a read-only container: mount an emptyDir at /tmp)"
        ) from None
    directory = owned.path
    # The workers get PROMETHEUS_MULTIPROC_DIR in their environment before their first import of
    # prometheus_client. This process imported it already (the flags' module needs it), so it switches
    # the documented way: a multiprocess ValueClass, before any of its own metrics exist.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
    result = 1
    try:
        async def main() -> None:
            nonlocal result
            supervisor = Supervisor(config, directory)
            if stale:
                supervisor.logger.info("metrics_dirs_removed", directories=stale, why="their supervisors are gone")
            result = await supervisor.run()

        run_loop(main())
    finally:
        owned.remove()
    return result
