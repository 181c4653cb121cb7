"""The image's HEALTHCHECK against processes: proxy variables, decoys, odd argv.

Each stand-in is a process started like the container's `python /opt/venv/bin/streamwarden serve ...`:
its command line and environment are what the check reads from /proc. Healthy or not is decided by an
HTTP server this test runs on the admin port the stand-in names.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.ports import free_port

from proxy import healthcheck

UP = ["--upstream", "http://backend:8000"]


class _Answer(http.server.BaseHTTPRequestHandler):
    """Answers every GET (a proxy's absolute-form request too) with the class's status."""

    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def answering(status: int) -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_Answer,), {"status": status}))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextlib.contextmanager
def stand_in(tmp_path: Path, *args: str | bytes, listen: bool = False) -> Iterator[subprocess.Popen[bytes]]:
    """A process whose argv is `python .../streamwarden serve ARGS`; it lives until the block ends.

    With `listen`, it holds a listening socket on the port after `--admin-port`, as the real one does.
    """
    script = tmp_path / "streamwarden"
    script.write_text(
        "import socket, sys\n"
        "if sys.argv[-1] == 'listen':\n"
        "    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "    s.bind(('127.0.0.1', int(sys.argv[sys.argv.index('--admin-port') + 1]))); s.listen()\n"
        "print('up', flush=True)\n"
        "sys.stdin.read()\n"
    )
    argv: list[str | bytes] = [sys.executable, str(script), "serve", *UP, *args, *(["listen"] if listen else [])]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"up\n"
        yield proc
    finally:
        assert proc.stdin is not None
        assert proc.stdout is not None
        proc.stdin.close()
        proc.wait(timeout=10)
        proc.stdout.close()


def run_check(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy.healthcheck", *args], capture_output=True, text=True, timeout=30,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env}, check=False,
    )


@pytest.mark.parametrize("variable", ["HTTP_PROXY", "http_proxy"])
def test_a_proxy_answering_200_does_not_pass_a_stopped_proxy(tmp_path: Path, variable: str) -> None:
    with answering(200) as liar, stand_in(tmp_path, "--admin-port", str(free_port())) as proc:
        result = run_check(str(proc.pid), env={variable: f"http://127.0.0.1:{liar}", "NO_PROXY": "localhost"})
    assert result.returncode == 1, result.stdout + result.stderr


def test_a_proxy_answering_502_does_not_fail_a_healthy_proxy(tmp_path: Path) -> None:
    with answering(502) as broken, answering(200) as admin, stand_in(tmp_path, "--admin-port", str(admin)) as proc:
        result = run_check(str(proc.pid), env={"HTTP_PROXY": f"http://127.0.0.1:{broken}", "NO_PROXY": "localhost"})
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_decoy_command_line_is_not_taken_for_the_proxy(tmp_path: Path) -> None:
    """A process that only *names* `streamwarden serve --admin-port P` is not the proxy on P."""
    with answering(200) as admin:
        with stand_in(tmp_path, "--admin-port", str(admin)) as decoy:
            assert healthcheck.find_serve([decoy.pid]) is None
        port = free_port()
        with stand_in(tmp_path, "--admin-port", str(port), listen=True) as real:
            assert healthcheck.find_serve([real.pid]) == (real.pid, f"http://127.0.0.1:{port}/healthz")


def test_an_argv_that_is_not_utf8_does_not_crash_the_search(tmp_path: Path) -> None:
    """A process anywhere in the namespace with a non-UTF-8 argument: the search goes on past it."""
    with stand_in(tmp_path, "--model", b"\xff\xfe") as odd:
        assert healthcheck.find_serve([odd.pid]) is None  # it holds no admin port
        result = run_check(env={})
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode in (0, 1)
