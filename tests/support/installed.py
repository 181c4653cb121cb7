"""The streamwarden of a fresh venv, as a user installs it: from the checkout (`pip install .`) or from a
built wheel; and the loopback smoke the install tests run on it (tests/process/test_*_install.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import venv
from pathlib import Path

import orjson

from support.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"


def clean_env(**extra: str) -> dict[str, str]:
    """No STREAMWARDEN_* settings and no PYTHONPATH from the test run leak into the installed commands."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMWARDEN_") and k != "PYTHONPATH"}
    return env | extra


def fresh_venv(home: Path, *pip_args: str, timeout: float) -> Path:
    """A venv at `home` holding what `pip install *pip_args` brings; returns its bin/.

    No pip of its own (ensurepip alone takes 5-10 s on a busy machine): the test run's pip installs into
    it with --python, the same resolution from the same index as the venv's own pip would make."""
    venv.create(home, with_pip=False)
    bin_dir = home / "bin"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "install", "--quiet", *pip_args],
        capture_output=True, text=True, timeout=timeout, env=clean_env(), cwd=home,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return bin_dir


def _wait_listening(port: int, proc: subprocess.Popen[bytes], within: float = 20) -> None:
    """Poll the port (a subprocess announces nothing we could wait on), bounded."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        assert proc.poll() is None, "process exited early"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listens on {port} after {within} s")


def serve_smoke(bin_dir: Path) -> None:
    """The installed `streamwarden fake-upstream` and `serve` on loopback: one streamed chat through the proxy,
    /healthz on the admin port, then SIGTERM: exit 0 and a request log line, no traceback."""
    fake_port, port, admin_port = free_ports(3)
    cmd = str(bin_dir / "streamwarden")
    out = subprocess.DEVNULL
    procs: list[subprocess.Popen[bytes]] = []
    try:
        fake = subprocess.Popen([cmd, "fake-upstream", "--port", str(fake_port)], stdout=out, stderr=out,
                                env=clean_env(), cwd="/")  # fmt: skip
        procs.append(fake)
        serve = [cmd, "serve", "--upstream", f"http://127.0.0.1:{fake_port}", "--host", "127.0.0.1",
                 "--port", str(port), "--admin-port", str(admin_port), "--drain-timeout", "1"]  # fmt: skip
        proxy = subprocess.Popen(serve, stdout=out, stderr=subprocess.PIPE, env=clean_env(), cwd="/")
        procs.append(proxy)
        for listening, proc in ((fake_port, fake), (port, proxy), (admin_port, proxy)):
            _wait_listening(listening, proc)

        body = orjson.dumps({"model": "m", "stream": True, "max_tokens": 3, "messages": []})
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=20) as resp:
            assert resp.status == 200
            assert resp.read().endswith(b"data: [DONE]\n\n")
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/healthz", timeout=20) as resp:
            assert resp.status == 200

        proxy.send_signal(signal.SIGTERM)
        assert proxy.wait(timeout=20) == 0
        assert proxy.stderr is not None
        log = proxy.stderr.read().decode()
        assert "Traceback" not in log
        assert '"event":"request"' in log
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            if proc.stderr is not None:
                proc.stderr.close()
