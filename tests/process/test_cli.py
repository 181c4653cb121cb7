"""`streamwarden` as a user runs it: subprocesses, real ports, signals."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from support import WAIT
from support.ports import free_ports

PY = sys.executable
_PORT_RACES = 3  # starts tried, each on new free ports


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
    [line] = done.stderr.strip().splitlines()  # no usage block above it (issue 35)
    assert line.startswith("streamwarden serve: error: argument ")
    assert flag in line
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("typo", "meant"),
    [("--idle-timout", "--idle-timeout"), ("--upstream-max-conections", "--upstream-max-connections"),
     ("--helth-path=/health", "--health-path")],
)
def test_a_mistyped_flag_is_one_line_naming_the_close_one(typo: str, meant: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMWARDEN_")}
    argv = ["serve", "--upstream", "http://x", *typo.split(" ")]
    done = subprocess.run([PY, "-m", "proxy", *argv], capture_output=True, text=True, timeout=30, env=env)
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line == f"streamwarden serve: error: unrecognized argument: {typo}; did you mean {meant}?"


def test_an_argument_far_from_every_flag_points_at_help() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMWARDEN_")}
    argv = ["serve", "--upstream", "http://x", "--frobnicate", "3"]
    done = subprocess.run([PY, "-m", "proxy", *argv], capture_output=True, text=True, timeout=30, env=env)
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line == (
        "streamwarden serve: error: unrecognized arguments: --frobnicate 3 (streamwarden serve --help lists the flags)"
    )


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


async def _until_not_ready(http: aiohttp.ClientSession, admin_port: int) -> None:
    async with asyncio.timeout(WAIT):
        while True:
            async with http.get(f"http://127.0.0.1:{admin_port}/readyz") as ready:
                if ready.status == 503:
                    return
            await asyncio.sleep(0.02)


Served = tuple[int, int, asyncio.subprocess.Process]


@pytest.fixture
async def serve_factory() -> AsyncIterator[Callable[..., Awaitable[Served]]]:
    """Start the fake upstream and `streamwarden serve` as subprocesses on free ports."""
    procs: list[asyncio.subprocess.Process] = []

    async def start(*flags: str) -> Served:
        """The ports are picked free beforehand (neither program takes port 0): another program on the
        machine may take one in between, and that start is made again on new ports."""
        for attempt in range(1, _PORT_RACES + 1):
            fake_port, port, admin_port = free_ports(3)
            fake = await asyncio.create_subprocess_exec(
                PY, "-m", "proxy", "fake-upstream", "--port", str(fake_port), "--token-rate", "0",
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )
            procs.append(fake)
            env = {**os.environ, "STREAMWARDEN_UPSTREAM": f"http://127.0.0.1:{fake_port}"}
            proxy = await asyncio.create_subprocess_exec(
                PY, "-m", "proxy", "serve", "--host", "127.0.0.1", "--port", str(port), "--admin-port",
                str(admin_port), *flags, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            )
            procs.append(proxy)
            try:
                await _wait_listening(fake_port, fake)
                await _wait_listening(port, proxy)
                await _wait_listening(admin_port, proxy)
            except AssertionError:  # one of them exited: its port taken, or a bug that every attempt shows
                if attempt == _PORT_RACES:
                    raise
                for proc in (fake, proxy):
                    if proc.returncode is None:
                        proc.kill()
                continue
            return port, admin_port, proxy
        raise AssertionError(f"{_PORT_RACES} starts tried")

    try:
        yield start
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


@pytest.fixture
async def served(serve_factory: Callable[..., Awaitable[Served]]) -> Served:
    return await serve_factory("--drain-timeout", "5")


async def test_serve_forwards_and_exits_cleanly_on_sigterm(served: Served) -> None:
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


async def test_sigterm_drains_streams_then_ends_them_with_a_shutdown_frame(
    serve_factory: Callable[..., Awaitable[Served]],
) -> None:
    port, admin_port, proc = await serve_factory("--drain-timeout", "1", "--hold-headers", "0")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2 * WAIT)) as http:
        streams = []
        for path, body in [
            ("/v1/chat/completions", {"model": "m", "stream": True, "messages": []}),
            ("/v1/messages", {"model": "m", "stream": True, "max_tokens": 16, "messages": []}),
        ]:
            resp = await http.post(f"http://127.0.0.1:{port}{path}", json=body,
                                   headers={"x-fault": "slow;rate=10;tokens=1000"})
            assert resp.status == 200
            await asyncio.wait_for(resp.content.readuntil(b"\n\n"), WAIT)
            streams.append(resp)
        signalled = asyncio.get_running_loop().time()
        proc.send_signal(signal.SIGTERM)
        await _until_not_ready(http, admin_port)  # /readyz turns 503 at once
        with pytest.raises(aiohttp.ClientConnectionError):  # the listener is closed
            async with http.get(f"http://127.0.0.1:{port}/v1/models"):
                pass
        tails = [await asyncio.wait_for(resp.content.read(), WAIT) for resp in streams]
        elapsed = asyncio.get_running_loop().time() - signalled
    assert 0.9 < elapsed < 15, elapsed  # ran on for the drain time, not for the streams' 100 s
    assert b'"code":"shutdown"' in tails[0]
    assert tails[0].endswith(b"data: [DONE]\n\n")
    assert tails[1].rstrip(b"\n").splitlines()[-2:][0] == b"event: error"
    assert await asyncio.wait_for(proc.wait(), 15) == 0
    assert proc.stderr is not None
    log = (await proc.stderr.read()).decode()
    assert log.count('"reason":"shutdown"') == 2
    assert "Traceback" not in log


async def test_second_signal_stops_at_once(serve_factory: Callable[..., Awaitable[Served]]) -> None:
    port, admin_port, proc = await serve_factory("--drain-timeout", "30")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
        resp = await http.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                               json={"model": "m", "stream": True, "messages": []},
                               headers={"x-fault": "slow;rate=10;tokens=1000"})
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), WAIT)
        proc.send_signal(signal.SIGTERM)
        await _until_not_ready(http, admin_port)  # the first signal started the drain
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), WAIT) == 0
        resp.close()


async def test_sigterm_gives_a_waiting_whole_body_request_a_503(
    serve_factory: Callable[..., Awaitable[Served]],
) -> None:
    port, admin_port, proc = await serve_factory("--drain-timeout", "0.5")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
        waiting = asyncio.ensure_future(http.post(
            f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": "m", "messages": []},
            headers={"x-fault": "late_headers;delay=30"},
        ))
        async with asyncio.timeout(WAIT):  # the request is in flight once the proxy counts it
            while True:
                async with http.get(f"http://127.0.0.1:{admin_port}/metrics") as resp:
                    if 'streamwarden_inflight_requests{api="chat_completions"} 1.0' in await resp.text():
                        break
                await asyncio.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        resp = await asyncio.wait_for(waiting, WAIT)  # the upstream would answer after 30 s
        assert resp.status == 503
        body = await resp.json()
        resp.close()
    assert body["error"]["code"] == "shutdown"
    assert await asyncio.wait_for(proc.wait(), 15) == 0


async def test_image_healthcheck_follows_serve_s_admin_port_argument(served: Served) -> None:
    """The HEALTHCHECK (`python -m proxy.healthcheck`) against a real `serve --admin-port N`."""
    _, _, proc = served
    check = [PY, "-m", "proxy.healthcheck", str(proc.pid)]
    env = {**os.environ, "STREAMWARDEN_ADMIN_PORT": "1"}  # the check's own environment must not matter
    healthy = await asyncio.create_subprocess_exec(*check, env=env)
    assert await asyncio.wait_for(healthy.wait(), 20) == 0
    proc.kill()
    await proc.wait()
    gone = await asyncio.create_subprocess_exec(*check, env=env, stderr=asyncio.subprocess.DEVNULL)
    assert await asyncio.wait_for(gone.wait(), 20) == 1


def test_version_says_the_version_and_whether_the_compiled_build_runs() -> None:
    # A checkout without `make compiled` runs the pure package; the image's answer is the container tier's.
    from proxy import __version__
    from proxy.cli import compiled

    done = subprocess.run([PY, "-m", "proxy", "--version"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"streamwarden {__version__} (compiled: {'yes' if compiled() else 'no'})\n"
