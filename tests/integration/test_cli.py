"""`streamwarden` as a user runs it: subprocesses, real ports, signals."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest

PY = sys.executable


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["serve"], "--upstream"),
        (["serve", "--upstream", "localhost:8000"], "--upstream"),
        (["serve", "--upstream", "http://x", "--idle-timeout", "-5"], "--idle-timeout"),
        (["serve", "--upstream", "http://x", "--port", "99999"], "--port"),
        (["serve", "--upstream", "http://x", "--max-body-size", "huge"], "--max-body-size"),
        (["serve", "--upstream", "http://x", "--log-format", "xml"], "--log-format"),
    ],
)
def test_bad_flags_exit_2_with_one_clear_line(argv: list[str], flag: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMWARDEN_")}
    done = subprocess.run([PY, "-m", "proxy", *argv], capture_output=True, text=True, timeout=30, env=env)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("usage: streamwarden serve")
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1
    assert flag in errors[0]
    assert "Traceback" not in done.stderr


def test_bad_environment_value_exits_2() -> None:
    env = {**os.environ, "STREAMWARDEN_UPSTREAM": "http://x", "STREAMWARDEN_KEEPALIVE_INTERVAL": "often"}
    done = subprocess.run([PY, "-m", "proxy", "serve"], capture_output=True, text=True, timeout=30, env=env)
    assert done.returncode == 2
    assert "STREAMWARDEN_KEEPALIVE_INTERVAL" in done.stderr
    assert "Traceback" not in done.stderr


async def _wait_listening(port: int, proc: asyncio.subprocess.Process) -> None:
    async with asyncio.timeout(20):
        while True:
            assert proc.returncode is None, "process exited early"
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            writer.close()
            return


@pytest.fixture
async def served() -> AsyncIterator[tuple[int, int, asyncio.subprocess.Process]]:
    fake_port, port, admin_port = _free_port(), _free_port(), _free_port()
    fake = await asyncio.create_subprocess_exec(
        PY, "-m", "proxy", "fake-upstream", "--port", str(fake_port), "--token-rate", "0",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    env = {**os.environ, "STREAMWARDEN_UPSTREAM": f"http://127.0.0.1:{fake_port}"}
    proxy = await asyncio.create_subprocess_exec(
        PY, "-m", "proxy", "serve", "--host", "127.0.0.1", "--port", str(port), "--admin-port", str(admin_port),
        "--drain-timeout", "5", env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    try:
        await _wait_listening(fake_port, fake)
        await _wait_listening(port, proxy)
        await _wait_listening(admin_port, proxy)
        yield port, admin_port, proxy
    finally:
        for proc in (proxy, fake):
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


async def test_serve_forwards_and_exits_cleanly_on_sigterm(
    served: tuple[int, int, asyncio.subprocess.Process],
) -> None:
    port, admin_port, proc = served
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
        async with http.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
        ) as resp:
            assert resp.status == 200
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")
        async with http.get(f"http://127.0.0.1:{admin_port}/healthz") as resp:
            assert resp.status == 200
        async with http.get(f"http://127.0.0.1:{admin_port}/readyz") as resp:
            assert resp.status == 200
        async with http.get(f"http://127.0.0.1:{admin_port}/metrics") as resp:
            text = await resp.text()
            assert "streamwarden_build_info{" in text
            assert "streamwarden_upstream_up 1.0" in text
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 15) == 0
    assert proc.stderr is not None
    log = (await proc.stderr.read()).decode()
    assert '"event":"started"' in log
    assert '"event":"request"' in log
    assert "Traceback" not in log
