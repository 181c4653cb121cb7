"""`streamwarden demo` and `streamwarden bench` as a user runs them: subprocesses, real output."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys

import aiohttp
import pytest

from proxy.bench import SideResult, format_table, percentile

PY = sys.executable


def _logical_lines(text: str) -> list[str]:
    """The demo's output with wrapped lines joined back (continuations are indented 11 spaces)."""
    lines: list[str] = []
    for line in text.splitlines():
        if line.startswith(" " * 11) and lines:
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    return lines


def _cases(text: str) -> dict[int, list[str]]:
    """Case number -> its logical lines."""
    cases: dict[int, list[str]] = {}
    current: list[str] | None = None
    for line in _logical_lines(text):
        match = re.match(r"^(\d)\. ", line)
        if match:
            current = cases.setdefault(int(match.group(1)), [])
        elif line.startswith("The proxy's metrics"):
            current = None
        if current is not None:
            current.append(line)
    return cases


def _side(lines: list[str], side: str, index: int = 0) -> str:
    found = [line for line in lines if line.startswith(f"  {side:<8} ")]
    assert len(found) > index, f"no {side} line {index} in {lines}"
    return found[index]


def _check_tour(out: str) -> None:
    assert "Traceback" not in out
    assert all(len(line) <= 80 for line in out.splitlines()), "wider than 80 columns"
    cases = _cases(out)
    assert sorted(cases) == [1, 2, 3, 4, 5]

    normal = cases[1]
    for side in ("direct", "through"):
        assert "no exception" in _side(normal, side)
        assert "'The fake upstream streams" in _side(normal, side)
    assert any("the same text; proxy log: ok/complete" in line for line in normal)

    stray = cases[2]
    direct = _side(stray, "direct")
    assert "InternalServerError" not in direct  # the 503 inside the body is not a status the SDK sees
    assert "text ''" in direct
    assert "the backend got 1 request(s)" in direct
    through = _side(stray, "through")
    assert "InternalServerError 503" in through
    assert "the backend got 2 request(s)" in through  # a real 503: the SDK retried it
    assert any("error/stray_http_block" in line for line in stray)

    error = cases[3]
    for side in ("direct", "through"):
        assert "APIError: fake upstream: generation failed" in _side(error, side)
    assert "still waiting after" in _side(error, "direct", 1)
    assert re.search(r"body ended after [\d.]+ s; events: chunk, chunk, error, \[DONE\]", _side(error, "through", 1))

    abandon = cases[4]
    assert "the backend is still busy" in _side(abandon, "direct")
    assert "no close seen" in _side(abandon, "direct")
    assert "the backend saw its connection close" in _side(abandon, "through")
    assert any("aborted/client_stalled" in line and "upstream cancelled" in line for line in abandon)

    null = cases[5]
    assert "no exception; create() returned None" in _side(null, "direct")
    assert "InternalServerError 502" in _side(null, "through")

    metrics = out[out.index("The proxy's metrics that moved") :]
    for expected in (
        '{outcome="ok", reason="complete"} 1',
        '{outcome="aborted", reason="client_stalled"} 1',
        '{outcome="error", reason="stray_http_block"} 2',
        '{reason="client_stalled"} 1',
    ):
        assert expected in metrics


def test_demo_runs_the_tour_and_exits_0() -> None:
    done = subprocess.run([PY, "-m", "proxy", "demo"], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stdout + done.stderr
    _check_tour(done.stdout)
    assert "stay up until Ctrl-C" not in done.stdout


async def test_demo_keep_running_serves_until_ctrl_c() -> None:
    proc = await asyncio.create_subprocess_exec(
        PY, "-m", "proxy", "demo", "--keep-running",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stderr is not None
    out = ""
    try:
        async with asyncio.timeout(45):
            while "stay up until Ctrl-C" not in out:
                line = await proc.stdout.readline()
                assert line, f"demo ended early:\n{out}"
                out += line.decode()
        proxy_url = re.search(r"streamwarden\s+(http://127\.0\.0\.1:\d+)", out)
        assert proxy_url is not None
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
            http.post(
                proxy_url.group(1) + "/v1/chat/completions",
                json={"model": "m", "stream": True, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
            ) as resp,
        ):
            assert resp.status == 200
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    _check_tour(out + (await proc.stdout.read()).decode())
    assert '"event":"request"' in (await proc.stderr.read()).decode()  # the by-hand request's log line


def test_bench_prints_both_sides() -> None:
    argv = [PY, "-m", "proxy", "bench", "--requests", "20", "--concurrency", "5", "--tokens", "20", "--abandons", "20"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=40)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert all(len(line) <= 80 for line in out.splitlines())
    assert re.search(r"^\s+direct\s+through proxy\s+difference$", out, re.M)
    assert re.search(r"^streams ok / failed\s+20 / 0\s+20 / 0$", out, re.M)
    for row in ("wall time", "TTFT p50", "TTFT p99", "full stream p50", "full stream p99"):
        assert re.search(rf"^{row}\s+[\d.]+ (s|ms)\s+[\d.]+ (s|ms)\s+[+-][\d.]+ (s|ms)$", out, re.M), row
    assert re.search(r"^events/s \(incl\. \[DONE\]\)\s+[\d,]+\s+[\d,]+$", out, re.M)
    assert re.search(r"^proxy CPU\s+-\s+[\d.]+ s$", out, re.M)
    assert re.search(r"^proxy CPU per event\s+-\s+[\d.]+ us$", out, re.M)
    assert re.search(r"^proxy RSS \(peak\)\s+-\s+[\d.]+ MiB \(\d+\)$", out, re.M)
    assert re.search(r"20 abandons\none at a time .*: p50 [\d.]+ ms, p99 [\d.]+ ms, max [\d.]+ ms$", out, re.M), out
    assert re.search(r"^cost per content event\s+[\d.]+ us \([\d.]+ us in the stream loop\)$", out, re.M), out
    pids = [int(pid) for pid in re.findall(r"\(pid (\d+)\)", out)]
    assert len(pids) == 2  # the fake upstream and the proxy, both stopped before bench exits
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read()  # noqa: SIM115


def test_bench_rejects_zero() -> None:
    done = subprocess.run([PY, "-m", "proxy", "bench", "--requests", "0"], capture_output=True, text=True, timeout=20)
    assert done.returncode == 2
    assert "at least 1" in done.stderr


@pytest.mark.parametrize(("values", "p50", "p99"), [([1.0], 1.0, 1.0), ([float(i) for i in range(1, 101)], 50.0, 99.0)])
def test_percentile_nearest_rank(values: list[float], p50: float, p99: float) -> None:
    assert percentile(values, 50) == p50
    assert percentile(values, 99) == p99
    assert percentile([], 50) is None


def test_table_fits_80_columns() -> None:
    direct = SideResult("direct", wall=1.5, ok=200, events=40600, ttft=[0.01] * 10, latency=[0.1] * 10)
    through = SideResult("through", wall=2.0, ok=199, failed=1, events=40397, ttft=[0.02], latency=[0.2],
                         proxy_cpu=1.25, proxy_rss=(45 * 2**20, 50 * 2**20), upstream_cpu=1.0)  # fmt: skip
    table = format_table(direct, through)
    assert all(len(line) <= 80 for line in table.splitlines())
    assert "30.9 us" in table  # 1.25 s / 40,397 events
    assert "199 / 1" in table
