"""A real backend's server process for the real tiers (llama-server, vLLM): started on a loopback port
with its output in a log file, waited for on `/health`, stopped by its PID.

Both tiers need the same guarantees from it, so they live in one place: a start that fails (or a test
timeout during the wait) leaves no process behind, a failure message ends with the server's own last
log lines, and `stop` always ends with SIGKILL for whatever SIGTERM did not stop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Self

__all__ = ["BackendProcess"]


@dataclass
class BackendProcess:
    """One backend server process; a subclass builds its command line and calls `launch`."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path
    model: Path

    name: ClassVar[str] = "the backend"  # in failure messages
    poll_every: ClassVar[float] = 0.1  # seconds between two `/health` probes
    term_wait: ClassVar[float] = 10.0  # seconds from SIGTERM to SIGKILL
    tail_lines: ClassVar[int] = 30
    own_session: ClassVar[bool] = False  # a server that forks workers: stop kills its whole group

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    def launch(
        cls, args: list[str], port: int, log: Path, model: Path, *, within: float, env: dict[str, str] | None = None
    ) -> Self:
        with log.open("wb") as sink:
            process = subprocess.Popen(
                args,
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=cls.own_session,
            )
        server = cls(process, f"http://127.0.0.1:{port}", log, model)
        try:
            server.spawned()
            server.wait_healthy(within)
        except BaseException:  # a failed start (or the test's timeout) leaves no server behind
            server.stop()
            raise
        return server

    def spawned(self) -> None:
        """What a server needs done to its process before it is waited for (nothing, by default)."""

    def wait_healthy(self, within: float) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(self.poll_every)
        raise RuntimeError(f"{self.name} was not healthy within {within} s: {self.tail()}")

    def tail(self, lines: int | None = None) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-(lines or self.tail_lines) :])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM (a server stops its own workers), SIGKILL if it is still there after `term_wait`."""
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=self.term_wait)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        if self.own_session:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)  # the group is this server's own (start_new_session)
