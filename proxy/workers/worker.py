"""One worker process of `serve --workers N` (`python -m proxy.workers.worker`, started by proxy/workers/supervisor.py).

The supervisor talks to its workers over their standard streams, which nothing else in the proxy
uses (logs go to stderr, inherited):
- stdin, supervisor -> worker: first a `WorkerBoot` (length-prefixed pickle: the supervisor's own
  validated Config, so the worker never re-reads flags or environment), then one JSON line per change
  of the upstream's model names (the supervisor runs the /readyz probe that learns them). EOF means
  the supervisor is gone: the worker drains and exits rather than live on as an orphan.
- stdout, worker -> supervisor: `ready` once the main port is bound, then `beat` every
  HEARTBEAT_SECONDS from the event loop: a worker whose loop is stuck (or that is SIGSTOPped) still
  holds its share of the port's connections, and only its silence tells (the supervisor kills it).

PROMETHEUS_MULTIPROC_DIR is in this process's environment from its start (the supervisor set it),
so prometheus_client is in multiprocess mode from its first import.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from proxy.config import Config
from proxy.observe.logs import make_logger
from proxy.observe.metrics import Metrics
from proxy.server.app import build_state
from proxy.server.fdlimit import connection_limit, raise_fd_limit
from proxy.server.serve import Server, run_loop
from proxy.workers.shared_labels import SharedModelLabels

__all__ = ["BEAT_LINE", "HEARTBEAT_SECONDS", "READY_LINE", "WorkerBoot", "encode_boot", "encode_models", "main"]

READY_LINE = b"ready\n"
BEAT_LINE = b"beat\n"
HEARTBEAT_SECONDS = 1.0
_LENGTH = struct.Struct("!I")


@dataclass(frozen=True, slots=True)
class WorkerBoot:
    """What a worker is told at birth."""

    config: Config  # the port already resolved by the supervisor (never 0)
    index: int  # 0..N-1, kept by the worker that replaces a dead one
    multiprocess_dir: str
    served_models: tuple[str, ...] | None  # the upstream's model names, when the supervisor knows them


def encode_boot(boot: WorkerBoot) -> bytes:
    body = pickle.dumps(boot)
    return _LENGTH.pack(len(body)) + body


def encode_models(names: list[str]) -> bytes:
    return orjson.dumps({"served_models": names}) + b"\n"


def _read_exactly(fd: int, n: int) -> bytes:
    """Unbuffered, so that not one byte of the lines after the boot is swallowed by a buffer."""
    chunks: list[bytes] = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            raise EOFError("the supervisor closed stdin before the boot message was complete")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _read_boot(fd: int = 0) -> WorkerBoot:
    (length,) = _LENGTH.unpack(_read_exactly(fd, _LENGTH.size))
    boot = pickle.loads(_read_exactly(fd, length))  # our own parent's bytes, over a pipe it made
    if not isinstance(boot, WorkerBoot):
        raise TypeError("not a WorkerBoot")
    return boot


async def _follow_supervisor(apply: Callable[[list[str]], None], request_stop: Callable[[], None]) -> None:
    """Apply the supervisor's model-name lines until stdin ends, then ask the worker to stop."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=16 * 1024 * 1024)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := await reader.readline():
            message = orjson.loads(line)
            names = message.get("served_models") if isinstance(message, dict) else None
            if isinstance(names, list):
                apply([name for name in names if isinstance(name, str)])
    finally:
        transport.close()
        request_stop()


def _tell_ready() -> None:
    os.write(1, READY_LINE)


async def _heartbeat() -> None:
    """A line per HEARTBEAT_SECONDS, written by the event loop itself: it stops when the loop does."""
    while True:
        await asyncio.sleep(HEARTBEAT_SECONDS)
        try:
            os.write(1, BEAT_LINE)
        except OSError:  # the supervisor is gone: stdin's EOF stops this worker
            return


async def _run(boot: WorkerBoot) -> None:
    config = boot.config
    limits = raise_fd_limit()
    logger = make_logger(config.log_format, config.log_level).bind(worker=boot.index, pid=os.getpid())
    metrics = Metrics(config.model_label_limit, multiprocess_dir=boot.multiprocess_dir)
    metrics.models = SharedModelLabels(config.model_label_limit, boot.multiprocess_dir)
    if boot.served_models is not None:
        metrics.models.set_served(list(boot.served_models))
    state = build_state(config, metrics=metrics, logger=logger)
    server = Server(
        config, state, max_connections=connection_limit(config.max_client_connections, limits[1]),
        admin=False, reuse_port=True,
    )

    def learn(names: list[str]) -> None:
        metrics.models.set_served(names)
        logger.info("upstream_models", models=len(names))

    follower = asyncio.ensure_future(_follow_supervisor(learn, server.request_stop))
    tasks = [follower]

    def started() -> None:
        _tell_ready()
        tasks.append(asyncio.ensure_future(_heartbeat()))

    try:
        await server.run(limits, on_started=started)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def main() -> None:
    run_loop(_run(_read_boot()))


if __name__ == "__main__":  # pragma: no cover
    # `python -m proxy.workers.worker` runs this file as `__main__`; the boot message names its classes.
    from proxy.workers.worker import main as worker_main

    worker_main()
