"""`streamwarden bench`: what the proxy costs, as the same streaming workload direct and through it.

The fake upstream and the proxy run as subprocesses (their own interpreters, like in production), so
the proxy's CPU time read from /proc is its own and not the load generator's. The load comes from this
process with aiohttp: first straight to the upstream, then through the proxy, each after a warm-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

import aiohttp
import orjson

from .bench_cancel import measure_abandons
from .bench_latency import format_latency_cost, measure_latency_cost

__all__ = ["SideResult", "cpu_seconds", "format_table", "memory", "percentile", "run_bench"]

HOST = "127.0.0.1"
START_TIMEOUT = 20.0  # seconds for a child to accept connections
STOP_TIMEOUT = 5.0  # seconds after SIGTERM before SIGKILL
REQUEST_TIMEOUT = 60.0
_FIRST_CONTENT = re.compile(rb'"(?:content|text|delta)":\s*"[^"]')
_DONE = b"data: [DONE]\n\n"


@dataclass
class SideResult:
    """One side's measured run: client-side timings, and the processes' CPU and memory when known."""

    name: str
    wall: float = 0.0
    ok: int = 0
    failed: int = 0
    events: int = 0
    ttft: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    proxy_cpu: float | None = None
    proxy_rss: tuple[int, int] | None = None  # (VmRSS, VmHWM) in bytes
    upstream_cpu: float | None = None
    client_cpu: float = 0.0  # this process (the load generator), user + system


# -- /proc ------------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process from /proc/<pid>/stat (None where there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # fields 14, 15 of stat(5)


def memory(pid: int) -> tuple[int, int] | None:
    """(VmRSS, VmHWM) in bytes from /proc/<pid>/status."""
    found: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    found[key] = int(value.split()[0]) * 1024
    except OSError:
        return None
    if len(found) < 2:
        return None
    return found["VmRSS"], found["VmHWM"]


# -- child processes ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


@dataclass
class _Child:
    name: str
    proc: asyncio.subprocess.Process
    log: IO[bytes]

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-2000:]


async def _wait_listening(child: _Child, port: int) -> None:
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


class _Children:
    """`python -m proxy ...` subprocesses, each stopped (SIGTERM, then SIGKILL) when the block exits,
    also on exceptions and Ctrl-C; their output goes to temporary files, shown if one fails to start."""

    def __init__(self) -> None:
        self._exit = contextlib.AsyncExitStack()

    async def __aenter__(self) -> _Children:
        await self._exit.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._exit.aclose()

    async def spawn(self, name: str, args: Sequence[str], port: int) -> _Child:
        log = self._exit.enter_context(tempfile.TemporaryFile())  # noqa: SIM115 (closed by the exit stack)
        env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMWARDEN_")}  # the defaults, measured
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", *args, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, env=env
        )
        self._exit.push_async_callback(lambda: asyncio.shield(_stop(proc)))
        child = _Child(name, proc, log)
        await _wait_listening(child, port)
        return child


# -- the load ------------------------------------------------------------------------------------------


async def _one_stream(session: aiohttp.ClientSession, url: str, body: bytes, side: SideResult) -> None:
    start = time.perf_counter()
    first: float | None = None
    events = 0
    carry = b""  # a lone trailing newline, which may pair with the next chunk's first byte
    tail = b""
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                text = (await resp.read())[:200].decode(errors="replace")
                raise RuntimeError(f"status {resp.status}: {text}")
            async for chunk in resp.content.iter_any():
                data = carry + chunk
                events += data.count(b"\n\n")
                carry = b"\n" if data.endswith(b"\n") and not data.endswith(b"\n\n") else b""
                if first is None and _FIRST_CONTENT.search(tail[-32:] + chunk):
                    first = time.perf_counter()
                tail = (tail + chunk)[-32:]
        if not tail.endswith(_DONE):
            raise RuntimeError("the stream ended without data: [DONE]")
    except (aiohttp.ClientError, OSError, RuntimeError, TimeoutError) as exc:
        side.failed += 1
        side.errors.append(str(exc) or type(exc).__name__)
        return
    end = time.perf_counter()
    side.ok += 1
    side.events += events
    side.latency.append(end - start)
    if first is not None:
        side.ttft.append(first - start)


async def _drive(base: str, body: bytes, requests: int, concurrency: int, side: SideResult) -> None:
    """`requests` streams with `concurrency` in flight, each on a pooled keep-alive connection."""
    url = base + "/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT, sock_connect=5)
    remaining = iter(range(requests))

    async def worker() -> None:
        for _ in remaining:
            await _one_stream(session, url, body, side)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for _ in range(min(concurrency, requests)):
                group.create_task(worker())
        side.wall = time.perf_counter() - start


async def _model(upstream: str) -> str:
    """The backend's first model id (a real server rejects unknown names); the fake takes any."""
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(upstream + "/v1/models") as resp:
        data = orjson.loads(await resp.read()) if resp.status == 200 else None
    models = data.get("data") if isinstance(data, dict) else None
    if models and isinstance(models[0], dict) and isinstance(models[0].get("id"), str):
        return str(models[0]["id"])
    return "bench"


async def _measure(
    name: str, base: str, body: bytes, requests: int, concurrency: int, proxy_pid: int | None, fake_pid: int | None
) -> SideResult:
    await _drive(base, body, min(requests, concurrency * 2), concurrency, SideResult("warm-up"))
    side = SideResult(name)
    proxy_before = cpu_seconds(proxy_pid) if proxy_pid else None
    fake_before = cpu_seconds(fake_pid) if fake_pid else None
    client_before = _own_cpu()
    await _drive(base, body, requests, concurrency, side)
    side.client_cpu = _own_cpu() - client_before
    if proxy_pid and proxy_before is not None:
        after = cpu_seconds(proxy_pid)
        side.proxy_cpu = after - proxy_before if after is not None else None
        side.proxy_rss = memory(proxy_pid)
    if fake_pid and fake_before is not None:
        after = cpu_seconds(fake_pid)
        side.upstream_cpu = after - fake_before if after is not None else None
    return side


def _own_cpu() -> float:
    times = os.times()
    return times.user + times.system


async def _bench(upstream: str | None, requests: int, concurrency: int, tokens: int, abandons: int) -> int:
    async with _Children() as children:
        fake_pid: int | None = None
        if upstream is None:
            fake_port = _free_port()
            args = ["fake-upstream", "--host", HOST, "--port", str(fake_port), "--token-rate", "0"]
            fake = await children.spawn("the fake upstream", args, fake_port)
            upstream, fake_pid = f"http://{HOST}:{fake_port}", fake.proc.pid
        upstream = upstream.rstrip("/")
        port, admin_port = _free_port(), _free_port()
        args = ["serve", "--upstream", upstream, "--host", HOST, "--port", str(port), "--admin-port",
                str(admin_port), "--log-level", "warning", "--drain-timeout", "1"]  # fmt: skip
        proxy = await children.spawn("the proxy", args, port)
        model = await _model(upstream)
        body = orjson.dumps({
            "model": model, "stream": True, "max_tokens": tokens,
            "messages": [{"role": "user", "content": "Write a long story."}],
        })  # fmt: skip
        print(_header(upstream, model, fake_pid, proxy.proc.pid, (requests, concurrency, tokens)), flush=True)
        direct = await _measure("direct", upstream, body, requests, concurrency, None, fake_pid)
        through = await _measure("through", f"http://{HOST}:{port}", body, requests, concurrency, proxy.proc.pid,
                                 fake_pid)  # fmt: skip
        abandon_line = ""
        if fake_pid is not None and abandons:
            latencies, missed = await measure_abandons(f"http://{HOST}:{port}", upstream, abandons, concurrency)
            abandon_line = _abandon_summary(latencies, missed)
    print(format_table(direct, through))
    if abandon_line:
        print(abandon_line)
    print(format_latency_cost(measure_latency_cost()))
    for side in (direct, through):
        if side.errors:
            print(f"{side.name}: {side.failed} failed, e.g. {side.errors[0][:70]}")
    return 1 if direct.failed or through.failed else 0


def _abandon_summary(latencies: list[float], missed: int) -> str:
    """One line: how soon the backend saw the close after the client left (built-in fake only)."""
    if not latencies:
        return f"client abandons: none measured ({missed} upstreams never seen to close)"
    return (
        f"client leaves -> upstream closed (as the fake saw it), {len(latencies)} abandons\n"
        f"one at a time beside the other streams: "
        f"p50 {_ms(percentile(latencies, 50))}, p99 {_ms(percentile(latencies, 99))}, "
        f"max {_ms(latencies[-1])}" + (f"; {missed} never closed" if missed else "")
    )


def run_bench(upstream: str | None, *, requests: int, concurrency: int, tokens: int, abandons: int = 200) -> int:
    """Run both sides and print the table; the exit code is 1 when a stream failed, 130 on Ctrl-C."""
    if requests < 1 or concurrency < 1 or tokens < 1:
        print("bench: --requests, --concurrency and --tokens must be at least 1", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_bench(upstream, requests, concurrency, tokens, abandons))
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, aiohttp.ClientError, OSError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1


# -- output --------------------------------------------------------------------------------------------


def _header(upstream: str, model: str, fake_pid: int | None, proxy_pid: int, args: tuple[int, int, int]) -> str:
    requests, concurrency, tokens = args
    backend = f"built-in fake, token rate 0 (pid {fake_pid})" if fake_pid else f"{upstream} (model {model})"
    return (
        f"streamwarden bench: {requests} streams per side, {concurrency} in flight, max_tokens {tokens}\n"
        f"upstream: {backend}\n"
        f"proxy: default settings, log level warning (pid {proxy_pid})\n"
        f"{os.cpu_count()} CPUs, shared by the upstream, the proxy and this client\n"
        "measuring direct, then through the proxy (each after a warm-up)..."
    )


def percentile(values: Sequence[float], pct: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(pct / 100 * len(ordered))))
    return ordered[rank - 1]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def _delta_ms(a: float | None, b: float | None) -> str:
    return "" if a is None or b is None else f"{(b - a) * 1000:+.1f} ms"


def format_table(direct: SideResult, through: SideResult) -> str:
    """The side-by-side table, 80 columns wide."""
    rows: list[tuple[str, str, str, str]] = []

    def rate(side: SideResult, count: float) -> str:
        return f"{count / side.wall:,.0f}" if side.wall > 0 else "-"

    rows.append(("wall time", f"{direct.wall:.2f} s", f"{through.wall:.2f} s", f"{through.wall - direct.wall:+.2f} s"))
    rows.append(("streams/s", rate(direct, direct.ok), rate(through, through.ok), ""))
    rows.append(("events/s (incl. [DONE])", rate(direct, direct.events), rate(through, through.events), ""))
    for label, values, pct in (
        ("TTFT p50", "ttft", 50), ("TTFT p99", "ttft", 99),
        ("full stream p50", "latency", 50), ("full stream p99", "latency", 99),
    ):  # fmt: skip
        a, b = percentile(getattr(direct, values), pct), percentile(getattr(through, values), pct)
        rows.append((label, _ms(a), _ms(b), _delta_ms(a, b)))
    rows.append(("streams ok / failed", f"{direct.ok} / {direct.failed}", f"{through.ok} / {through.failed}", ""))
    cpu = through.proxy_cpu
    rows.append(("proxy CPU", "-", "n/a" if cpu is None else f"{cpu:.2f} s", ""))
    per_event = f"{cpu / through.events * 1e6:.1f} us" if cpu is not None and through.events else "n/a"
    rows.append(("proxy CPU per event", "-", per_event, ""))
    if through.proxy_rss is not None:
        rss, peak = through.proxy_rss
        rows.append(("proxy RSS (peak)", "-", f"{rss / 2**20:.1f} MiB ({peak / 2**20:.0f})", ""))
    if direct.upstream_cpu is not None and through.upstream_cpu is not None:
        rows.append(("fake upstream CPU", f"{direct.upstream_cpu:.2f} s", f"{through.upstream_cpu:.2f} s", ""))
    rows.append(("bench client CPU", f"{direct.client_cpu:.2f} s", f"{through.client_cpu:.2f} s", ""))
    lines = [f"{'':<26}{'direct':>16}{'through proxy':>18}{'difference':>18}", "-" * 78]
    lines += [f"{label:<26}{a:>16}{b:>18}{d:>18}".rstrip() for label, a, b, d in rows]
    lines += [
        "The proxy's own cost is its CPU per event. Wall times and latencies measure the",
        "whole machine: the client is Python too, and through the proxy it often gets",
        "fewer, larger reads (the proxy coalesces events), so 'through' can even win.",
    ]
    return "\n".join(lines)
