"""`make run` owns what it starts. Its fake must be its own, the banner comes only once the
proxy answers, a failed start is one line and exit 2, and killing `make` frees every port.

The kill test runs the real `make run`; the failure cases run its launcher (scripts/run.py) directly,
because make adds its own `*** Error 2` line to any failed recipe.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
WAIT = 30.0
MAKE = shutil.which("make")


@contextlib.contextmanager
def held(port: int) -> Iterator[None]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        yield


def listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


def launcher_env(port: int, admin: int, fake: int, upstream: str = "") -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("STREAMWARDEN_")}
    return {**clean, "PORT": str(port), "ADMIN_PORT": str(admin), "FAKE_PORT": str(fake), "UPSTREAM": upstream,
            "BIN": str(BIN)}


def launch(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "run.py")], env=env, capture_output=True,
                          text=True, timeout=WAIT * 2, check=False)


def read_until(proc: subprocess.Popen[bytes], marker: str) -> str:
    """stdout up to `marker` (bounded); fails if the process ends first. Raw reads: a buffered reader
    would hold lines the selector no longer reports."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    seen = b""
    deadline = time.monotonic() + WAIT
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while marker.encode() not in seen:
            left = deadline - time.monotonic()
            ready = left > 0 and selector.select(left)
            assert ready, f"no {marker!r} within {WAIT} s: {seen.decode()}"
            chunk = os.read(fd, 65536)
            assert chunk, f"ended before {marker!r}: {seen.decode()}"
            seen += chunk
    return seen.decode()


@pytest.mark.skipif(MAKE is None, reason="make is not installed")
def reap(proc: subprocess.Popen[bytes]) -> None:
    """A launcher that a test ended (or that failed it) killed if still running, waited for, its pipes closed."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def test_killing_make_stops_the_proxy_and_the_fake() -> None:
    port, admin, fake = free_ports(3)
    assert MAKE is not None
    make = subprocess.Popen(
        [MAKE, "-s", "-C", str(ROOT), "run", f"PORT={port}", f"ADMIN_PORT={admin}", f"FAKE_PORT={fake}",
         f"VENV={BIN.parent}"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=launcher_env(port, admin, fake),
    )
    try:
        banner = read_until(make, "Stop with Ctrl-C")
        assert f"http://127.0.0.1:{port}" in banner
        assert all(listening(p) for p in (port, admin, fake)), "the banner comes once everything answers"
        make.kill()  # SIGKILL: make can pass nothing on
        make.wait(WAIT)
        deadline = time.monotonic() + WAIT
        while any(listening(p) for p in (port, admin, fake)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in (port, admin, fake) if listening(p)], "a child of make run outlived it"
    finally:
        if make.poll() is None:
            make.kill()
        make.wait()
        if make.stdout is not None:
            make.stdout.close()


def test_a_busy_fake_port_is_one_line_before_anything_starts() -> None:
    port, admin, fake = free_ports(3)
    with held(fake):
        done = launch(launcher_env(port, admin, fake))
    assert done.returncode == 2
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert re.fullmatch(rf"make run: in use: FAKE_PORT={fake}; pick others, e\.g\. make run FAKE_PORT=\d+", line)
    assert int(line.rsplit("=", 1)[1]) > fake  # the hint names the variable that is busy
    assert not listening(port)


def test_a_busy_proxy_port_is_one_line_and_no_banner() -> None:
    port, admin, fake = free_ports(3)
    with held(port):
        done = launch(launcher_env(port, admin, fake))
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert re.fullmatch(rf"make run: in use: PORT={port}; pick others, e\.g\. make run PORT=\d+", line)
    assert "Stop with Ctrl-C" not in done.stdout
    assert not listening(fake), "the fake was not started, or was stopped"


def test_a_busy_admin_port_names_admin_port_in_its_hint() -> None:
    port, admin, fake = free_ports(3)
    with held(admin):
        done = launch(launcher_env(port, admin, fake))
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert re.fullmatch(rf"make run: in use: ADMIN_PORT={admin}; pick others, e\.g\. make run ADMIN_PORT=\d+", line)
    assert " PORT=" not in line.split(";")[1]


def test_a_proxy_that_cannot_start_is_its_one_line_and_no_banner() -> None:
    port, admin, fake = free_ports(3)
    done = launch(launcher_env(port, admin, fake, upstream="http://no-such-backend.invalid:8000"))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        line for line in done.stderr.splitlines() if line.startswith("streamwarden serve: cannot resolve")
    ]
    assert len(done.stderr.splitlines()) == 1
    assert "Stop with Ctrl-C" not in done.stdout


@pytest.mark.parametrize(
    ("upstream", "line"),
    [
        ("http://127.0.0.1:9/v1", "streamwarden serve: error: argument --upstream: expected the backend's root URL, "
         "without /v1 (the clients' paths carry it: write http://127.0.0.1:9), got 'http://127.0.0.1:9/v1'"),
    ],
)
def test_a_bad_upstream_value_is_its_one_line_and_no_usage_block(upstream: str, line: str) -> None:
    """`make run UPSTREAM=.../v1` (issue 35): the one line that matters, not 20 lines of usage above it."""
    port, admin, fake = free_ports(3)
    done = launch(launcher_env(port, admin, fake, upstream=upstream))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [line]
    assert "Stop with Ctrl-C" not in done.stdout


def test_sigterm_to_the_launcher_drains_and_stops_both() -> None:
    port, admin, fake = free_ports(3)
    launcher = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "run.py")], env=launcher_env(port, admin, fake),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        read_until(launcher, "Stop with Ctrl-C")
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(WAIT) == 128 + signal.SIGTERM
        assert not [p for p in (port, admin, fake) if listening(p)]
        assert launcher.stderr is not None
        log = launcher.stderr.read().decode()
        assert "stopped" in log
        assert "Traceback" not in log
    finally:
        reap(launcher)


@contextlib.contextmanager
def models_upstream(models: list[str]) -> Iterator[str]:
    """A backend that answers GET /v1/models with `models` (and nothing else), on a free port."""
    body = json.dumps({"object": "list", "data": [{"id": name, "object": "model"} for name in models]}).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status = 200 if self.path == "/v1/models" else 404
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body) if status == 200 else 0))
            self.end_headers()
            if status == 200:
                self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(WAIT)


def banner_of(upstream: str) -> tuple[str, str]:
    """The launcher's banner in front of `upstream`, and its stderr after a SIGTERM."""
    port, admin, fake = free_ports(3)
    launcher = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "run.py")],
                                env=launcher_env(port, admin, fake, upstream=upstream),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        banner = read_until(launcher, "Stop with Ctrl-C")
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(WAIT)
        assert launcher.stderr is not None
        return banner, launcher.stderr.read().decode()
    finally:
        reap(launcher)


def test_with_upstream_the_hints_name_its_first_model_not_the_fakes() -> None:
    """`make run UPSTREAM=...` (issue 35): the curl asks for the upstream's own model, no fake fault."""
    with models_upstream(["Qwen/Qwen2.5-1.5B-Instruct", "other"]) as upstream:
        banner, _ = banner_of(upstream)
    assert '"model":"Qwen/Qwen2.5-1.5B-Instruct"' in banner
    assert "x-fault" not in banner
    assert '"model":"demo"' not in banner
    assert "upstream:" not in banner  # it answered


def test_with_a_dead_upstream_the_banner_and_the_log_say_so_at_once() -> None:
    """`make run UPSTREAM=http://127.0.0.1:9` (issue 35): not the fake's hints as if all were well."""
    [dead] = free_ports(1)
    banner, log = banner_of(f"http://127.0.0.1:{dead}")
    assert "upstream:     GET /v1/models: Connection refused: requests get an error until it answers" in banner
    assert '"model":"MODEL"' in banner
    assert "x-fault" not in banner
    assert "upstream_down" in log  # the proxy's probe at start, before any request


# --- the virtualenv's Python ------------------------------------------------------------------------------


def stub_python(folder: Path, version: str) -> Path:
    """An interpreter that says it is `version` and fails the 3.11 check, as a Python 3.10 would."""
    folder.mkdir(parents=True, exist_ok=True)
    stub = folder / "python"
    stub.write_text(f'#!/bin/sh\ncase "$*" in *version_info*) exit 1;; esac\necho "Python {version}"\n')
    stub.chmod(0o755)
    return stub


def test_a_venv_older_than_3_11_is_made_again(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    stub_python(venv / "bin", "3.10.12")
    (venv / "left-over").write_text("")
    done = subprocess.run(["sh", str(ROOT / "scripts" / "ensure-venv.sh"), sys.executable, str(venv)],
                          capture_output=True, text=True, timeout=WAIT * 4, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [f"{venv}: its Python is older than 3.11 or broken; making it again with "
                                        f"{sys.executable}"]
    assert not (venv / "left-over").exists()
    check = subprocess.run([str(venv / "bin" / "python"), "-c", "import sys; print(sys.version_info >= (3, 11))"],
                           capture_output=True, text=True, timeout=WAIT, check=False)
    assert check.stdout.strip() == "True"


def test_an_old_python_gets_a_one_line_hint(tmp_path: Path) -> None:
    old = stub_python(tmp_path / "old", "3.10.12")
    done = subprocess.run(["sh", str(ROOT / "scripts" / "ensure-venv.sh"), str(old), str(tmp_path / "venv")],
                          capture_output=True, text=True, timeout=WAIT, check=False)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"streamwarden needs Python 3.11 or newer; {old} is Python 3.10.12: "
        "run make with PYTHON=python3.12 (or another)"
    ]
    assert not (tmp_path / "venv").exists()


@pytest.mark.skipif(MAKE is None, reason="make is not installed")
def test_make_demo_on_a_fresh_clone_installs_only_what_the_demo_needs(tmp_path: Path) -> None:
    """`make demo` installed the whole test toolchain first (36 s for a 30-second tour).
    A dry run against a virtualenv that does not exist shows what it would install."""
    assert MAKE is not None
    done = subprocess.run([MAKE, "-n", "-C", str(ROOT), "demo", f"VENV={tmp_path / 'venv'}"],
                          capture_output=True, text=True, timeout=WAIT, check=False)
    assert done.returncode == 0, done.stderr
    extras = re.findall(r"pip install .*?-e '\.\[([a-z,]*)\]'", done.stdout)
    assert extras, done.stdout
    assert all(set(found.split(",")) == {"speed", "demo"} for found in extras), extras
