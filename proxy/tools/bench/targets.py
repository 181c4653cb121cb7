"""`streamwarden bench`'s processes: the fast fake, streamwarden, nginx and the floor, and what /proc says of them.

Each runs as its own subprocess, so its CPU time read from /proc is its own and not the load
generator's. CPU and memory are read for the process and its descendants (nginx's worker,
streamwarden's workers when it has more than one).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from yarl import URL

__all__ = ["HOST", "Children", "Target", "free_port", "nginx_config", "source_env", "tree_cpu", "tree_rss"]

HOST = "127.0.0.1"
START_TIMEOUT = 20.0  # seconds for a child to accept connections
STOP_TIMEOUT = 5.0  # seconds after SIGTERM before SIGKILL


@dataclass(frozen=True)
class Target:
    """Where the load goes: `direct` (the upstream itself), `nginx`, `floor` or a `streamwarden`."""

    name: str
    url: URL
    pid: int | None  # the process whose CPU and memory are the target's cost (None: not measured)


# -- /proc -------------------------------------------------------------------------------------------


def _stat(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (one scan of /proc)."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                fields = _stat(int(entry))
                if fields is not None:
                    children.setdefault(int(fields[1]), []).append(int(entry))  # field 4 of stat(5): ppid
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children.get(current, [])
    return found


def _schedstat(pid: int) -> float | None:
    """Nanosecond CPU time of every thread of `pid` (/proc/<pid>/task/*/schedstat), in seconds."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


def tree_cpu(pid: int) -> float | None:
    """CPU time of `pid` and its descendants, in seconds (None where there is no /proc).

    From schedstat (nanoseconds) where the kernel has it, else utime + stime (clock ticks, 10 ms)."""
    total, seen = 0.0, False
    for member in _tree(pid):
        precise = _schedstat(member)
        if precise is not None:
            total, seen = total + precise, True
            continue
        fields = _stat(member)
        if fields is not None:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # fields 14, 15 of stat(5)
            seen = True
    return total if seen else None


def tree_rss(pid: int) -> int | None:
    """Resident memory of `pid` and its descendants, in bytes (from /proc/<pid>/statm)."""
    total, seen = 0, False
    for member in _tree(pid):
        try:
            with open(f"/proc/{member}/statm", "rb") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
                seen = True
        except (OSError, IndexError, ValueError):
            continue
    return total if seen else None


# -- child processes ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


@dataclass
class Child:
    name: str
    proc: asyncio.subprocess.Process
    log: IO[bytes]

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-2000:]


async def _wait_listening(child: Child, port: int) -> None:
    try:
        async with asyncio.timeout(START_TIMEOUT):
            while True:
                if child.proc.returncode is not None:
                    raise RuntimeError(f"{child.name} exited with {child.proc.returncode}:\n{child.output()}")
                try:
                    _, writer = await asyncio.open_connection(HOST, port)
                except OSError:
                    await asyncio.sleep(0.05)
                    continue
                writer.close()
                await writer.wait_closed()
                return
    except TimeoutError:
        raise RuntimeError(f"{child.name} did not listen on port {port} within {START_TIMEOUT:.0f} s") from None


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), STOP_TIMEOUT)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


class Children:
    """Subprocesses, each stopped (SIGTERM, then SIGKILL) when the block exits, also on exceptions and
    Ctrl-C; their output goes to temporary files, shown if one fails to start."""

    def __init__(self) -> None:
        self._exit = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Children:
        await self._exit.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._exit.aclose()

    def tempdir(self) -> Path:
        return Path(self._exit.enter_context(tempfile.TemporaryDirectory(prefix="streamwarden-bench-")))

    async def spawn(self, name: str, argv: Sequence[str], port: int, source: Path | None = None) -> Child:
        """`argv` started; with `source`, its `proxy` package is the one in that checkout (the working
        directory and PYTHONPATH)."""
        log = self._exit.enter_context(tempfile.TemporaryFile())  # noqa: SIM115 (closed by the exit stack)
        env = source_env(source)
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, env=env, cwd=source
        )
        self._exit.push_async_callback(lambda: asyncio.shield(_stop(proc)))
        child = Child(name, proc, log)
        await _wait_listening(child, port)
        return child

    async def fast_fake(self) -> tuple[Child, URL]:
        port = free_port()
        argv = [sys.executable, "-m", "proxy", "fake-upstream", "--fast", "--host", HOST, "--port", str(port)]
        return await self.spawn("the fast fake upstream", argv, port), URL.build(scheme="http", host=HOST, port=port)

    async def streamwarden(self, upstream: URL, extra: Sequence[str] = (), source: Path | None = None,
                           name: str = "streamwarden") -> tuple[Child, URL]:  # fmt: skip
        """This checkout's streamwarden, or with `source` the one of another checkout (same interpreter)."""
        port, admin_port = free_port(), free_port()
        argv = [sys.executable, "-m", "proxy", "serve", "--upstream", str(upstream), "--host", HOST,
                "--port", str(port), "--admin-port", str(admin_port), "--drain-timeout", "1", *extra]  # fmt: skip
        return await self.spawn(name, argv, port, source), URL.build(scheme="http", host=HOST, port=port)

    async def floor(self, upstream: URL) -> tuple[Child, URL] | None:
        """The floor (`proxy.tools.bench.floor`) in front of `upstream`; None for an https upstream."""
        if upstream.scheme != "http":
            return None
        port = free_port()
        argv = [sys.executable, "-m", "proxy.tools.bench.floor", "--listen", f"{HOST}:{port}",
                "--upstream", f"{upstream.host}:{upstream.port}"]  # fmt: skip
        return await self.spawn("the floor", argv, port), URL.build(scheme="http", host=HOST, port=port)

    async def nginx(self, upstream: URL) -> tuple[Child, URL] | None:
        """nginx in front of `upstream`, or None when there is no `nginx` on the PATH."""
        binary = shutil.which("nginx")
        if binary is None:
            return None
        prefix, port = self.tempdir(), free_port()
        (prefix / "nginx.conf").write_text(nginx_config(prefix, port, upstream))
        argv = [binary, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-e", str(prefix / "error.log")]
        return await self.spawn("nginx", argv, port), URL.build(scheme="http", host=HOST, port=port)


def source_env(source: Path | None) -> dict[str, str]:
    """The environment of a child: no STREAMWARDEN_ settings (the defaults are measured), and with
    `source`, that checkout first on the import path (ahead of this venv's editable install)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMWARDEN_")}
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(source), *filter(None, [env.get("PYTHONPATH")])])
    return env


def nginx_config(prefix: Path, port: int, upstream: URL) -> str:
    """The reference: one worker, no buffering, a keep-alive upstream pool, HTTP/1.1 to the upstream,
    no access log; timeouts long enough for any generation."""
    scheme = "https" if upstream.scheme == "https" else "http"
    tls = "        proxy_ssl_server_name on;\n" if scheme == "https" else ""
    return f"""daemon off;
master_process on;
worker_processes 1;
worker_rlimit_nofile 65536;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 16384; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    upstream backend {{
        server {upstream.host}:{upstream.port};
        keepalive 1024;
        keepalive_requests 1000000;
    }}
    server {{
        listen {HOST}:{port} backlog=4096;
        keepalive_requests 1000000;
        client_max_body_size 64m;
        location / {{
            proxy_pass {scheme}://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $proxy_host;
            proxy_buffering off;
            proxy_read_timeout 600s;
            proxy_send_timeout 600s;
{tls}        }}
    }}
}}
"""
