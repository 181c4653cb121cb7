"""The measuring scripts' processes on loopback: a free port, a wait for a listener, a process that is
stopped on the way out. Children run from `/`: `python -m` puts the working directory first on
sys.path, so from a checkout it would shadow the `proxy` package the caller chose with PYTHONPATH."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator

__all__ = ["free_port", "running", "wait_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.1)
    raise SystemExit(f"nothing listened on {port} within {within:g} s")


@contextlib.contextmanager
def running(
    cmd: list[str], port: int, env: dict[str, str], *, within: float = 60.0
) -> Iterator[subprocess.Popen[bytes]]:
    """`cmd` started, listening on `port` within `within` s; terminated (then killed) at the end."""
    proc = subprocess.Popen(cmd, env=env, cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, proc, within)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
