"""A plain `pip install .` into a fresh venv, as a newcomer does it.

Every console subcommand either works or says in one line which extra to install and exits 2. The venv
has none of the extras, so this also shows that nothing outside `[project] dependencies` is imported by
`serve`, `fake-upstream` or `bench`. Installing takes a while (a wheel build and the dependencies from
the configured index or pip's cache), so the venv is made once per session.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import venv
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from support.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]
INSTALL_TIMEOUT = 600


def _env() -> dict[str, str]:
    """No STREAMWARDEN_* settings and no PYTHONPATH from the test run leak into the installed commands."""
    return {k: v for k, v in os.environ.items() if not k.startswith("STREAMWARDEN_") and k != "PYTHONPATH"}


@pytest.fixture(scope="session")
def plain_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin/ of a fresh venv holding `pip install .` and nothing else."""
    home = tmp_path_factory.mktemp("plain-venv")
    # No pip of its own (ensurepip alone takes 5-10 s on a busy machine): the test run's pip installs into
    # it with --python, the same resolution from the same index as the venv's own pip would make.
    venv.create(home, with_pip=False)
    bin_dir = home / "bin"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "install", "--quiet", str(ROOT)],
        capture_output=True, text=True, timeout=INSTALL_TIMEOUT, env=_env(), cwd=home,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return bin_dir


def _run(bin_dir: Path, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(bin_dir / "streamwarden"), *argv], capture_output=True, text=True, timeout=timeout, env=_env(), cwd="/"
    )


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


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            if proc.stderr is not None:
                proc.stderr.close()


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT + 60)
def test_plain_install_has_no_extras(plain_bin: Path) -> None:
    """The premise of the tests below: the SDKs come only with extras; the data plane's parser and loop
    (httptools, and uvloop on Linux) are plain dependencies."""
    for module in ("openai", "anthropic", "pytest"):
        done = subprocess.run([str(plain_bin / "python"), "-c", f"import {module}"], capture_output=True, timeout=30)
        assert done.returncode != 0, f"{module} is installed by a plain `pip install .`"
    for module in ("httptools", "uvloop"):
        done = subprocess.run([str(plain_bin / "python"), "-c", f"import {module}"], capture_output=True, timeout=30)
        assert done.returncode == 0, f"{module} is not installed by a plain `pip install .`"


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT + 60)
def test_demo_names_its_extra_in_one_line_and_exits_2(plain_bin: Path) -> None:
    done = _run(plain_bin, "demo")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "streamwarden demo: needs the 'openai' package: pip install 'streamwarden[demo]'"
    ]
    assert done.stdout == ""


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT + 60)
def test_serve_and_fake_upstream_work(plain_bin: Path, processes: list[subprocess.Popen[bytes]]) -> None:
    fake_port, port, admin_port = free_ports(3)
    cmd = str(plain_bin / "streamwarden")
    out = subprocess.DEVNULL
    processes.append(subprocess.Popen([cmd, "fake-upstream", "--port", str(fake_port)], stdout=out, stderr=out,
                                      env=_env(), cwd="/"))  # fmt: skip
    serve = [cmd, "serve", "--upstream", f"http://127.0.0.1:{fake_port}", "--host", "127.0.0.1", "--port", str(port),
             "--admin-port", str(admin_port), "--drain-timeout", "1"]  # fmt: skip
    proxy = subprocess.Popen(serve, stdout=out, stderr=subprocess.PIPE, env=_env(), cwd="/")
    processes.append(proxy)
    for listening, proc in ((fake_port, processes[0]), (port, proxy), (admin_port, proxy)):
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


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT + 120)
def test_bench_works(plain_bin: Path) -> None:
    done = _run(plain_bin, "bench", "--quick", "--scenarios", "b,c,abandon", timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "b: 16 concurrent streams" in done.stdout
    assert "requests/s" in done.stdout
    assert "client closes -> the upstream sees its connection close" in done.stdout

