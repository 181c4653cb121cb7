"""`streamwarden demo` and `streamwarden bench` as a user runs them: subprocesses, real output."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from support.ports import free_port

from proxy.tools.bench.load import Scenario, Window
from proxy.tools.bench.report import format_scenario, percentile, summarize

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
    assert sorted(cases) == [1, 2, 3, 4, 5, 6]

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

    resume = cases[6]  # resume seen with the built-in fake (x-fault: cut;once=1)
    assert "the backend got 1 request(s)" in _side(resume, "through")
    assert any("error/stream_cut" in line for line in resume)
    resumed = _side(resume, "resume")
    assert "no exception" in resumed
    assert "'The fake upstream streams" in resumed
    assert "the backend got 2 request(s)" in resumed
    assert any("ok/complete" in line and "resumed 1 time" in line for line in resume)

    metrics = out[out.index("The proxy's metrics that moved") :]
    for expected in (
        '{outcome="ok", reason="complete"} 1',
        '{outcome="aborted", reason="client_stalled"} 1',
        '{outcome="error", reason="stray_http_block"} 2',
        '{reason="client_stalled"} 1',
    ):
        assert expected in metrics


@pytest.mark.timeout(150)  # the tour takes 10 s alone; a busy machine makes it several times that
def test_demo_runs_the_tour_and_exits_0() -> None:
    done = subprocess.run([PY, "-m", "proxy", "demo"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    _check_tour(done.stdout)
    assert "stay up until Ctrl-C" not in done.stdout


@pytest.mark.timeout(150)  # as above: a whole tour first
async def test_demo_keep_running_serves_until_ctrl_c() -> None:
    proc = await asyncio.create_subprocess_exec(
        PY, "-m", "proxy", "demo", "--keep-running",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stderr is not None
    out = ""
    try:
        async with asyncio.timeout(120):
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


def _bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "proxy", "bench", *args], capture_output=True, text=True, timeout=170, env=env)


def _table(out: str, title: str) -> list[str]:
    """The lines of one scenario's table: its title up to the next blank line."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed (apt-get install nginx)")
@pytest.mark.timeout(180)  # a subprocess that starts the fake, nginx and streamwarden per scenario
def test_bench_quick_measures_direct_nginx_the_floor_and_streamwarden(tmp_path: Path) -> None:
    out_json = tmp_path / "bench.json"
    done = _bench("--quick", "--json", str(out_json))
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "Traceback" not in out + done.stderr
    assert [line for line in out.splitlines() if len(line) > 80 and not line.startswith("figures written to ")] == []
    assert re.search(r"^nginx [\d.]+: proxy_buffering off, 1 worker", out, re.M), out
    assert re.search(r"load average [\d.]+ [\d.]+ [\d.]+$", out, re.M)
    assert re.search(r"^load average after: [\d.]+ [\d.]+ [\d.]+$", out, re.M)
    assert re.search(r"^floor: uvloop protocols, httptools, keep-alive pool", out, re.M), out
    build = r"^streamwarden: default flags\n  streamwarden [\w.+-]+ \(compiled: (yes|no)\)\n  from /"
    assert re.search(build, out, re.M), out
    for title, rate in (("a: 8 clients", "events/s"), ("b: 16 concurrent", "events/s"), ("c: 8 clients", "requests/s"),
                        ("c8: 8 clients, whole", "requests/s"), ("c8: 8 clients, streams", "events/s")):  # fmt: skip
        table = _table(out, title)
        assert re.match(r"^\s+direct\s+nginx\s+floor\s+streamwarden$", table[1]), table
        assert re.match(rf"^{rate}(\s+[\d,]+){{4}}$", table[3]), table
        rows = {line[:22].strip(): line[22:].split() for line in table[3:]}
        assert rows["vs direct"][0] == "1.00x"
        ok = rows["ok / failed"]
        assert ok[1::3] == ["/"] * 4
        assert ok[2::3] == ["0"] * 4  # none failed
        assert all(int(n) > 0 for n in ok[::3]), ok
        assert rows["CPU-us per " + ("request" if rate == "requests/s" else "event")][0] == "-"
        assert re.fullmatch(r"[\d.]+x", rows["vs nginx"][3]), rows
        assert rows["vs floor"][2] == "1.00x"
        assert re.fullmatch(r"[\d.]+x", rows["vs floor"][3]), rows
        assert re.fullmatch(r"\(\+?-?[\d.]+\)", rows["TTFB p99 ms (added)"][-1]), rows
    abandon = _table(out, "abandon: 30 streams")
    rows = [line.split() for line in abandon[5:9]]
    assert [row[0] for row in rows] == ["direct", "nginx", "floor", "streamwarden"]
    for _, closes, p50, p95, top, ended_first, never, failed in rows:
        assert int(closes) + int(ended_first) == 10  # a third of 30, each timed unless the upstream ended first
        assert (never, failed) == ("0", "0")
        assert all(re.fullmatch(r"[\d.]+|-", cell) for cell in (p50, p95, top))
    assert re.search(r"^cost per content event\s+[\d.]+ us", out, re.M)
    for title, latency in (("one client alone: whole answers", "answer"), ("one client alone: streams", "TTFT")):
        table = _table(out, title)
        assert re.match(r"^\s+direct\s+nginx\s+floor\s+streamwarden$", table[1]), table
        rows = {line[:22].strip(): line[22:].split() for line in table[3:]}
        for pct in (50, 99):  # two decimals: the goals are fractions of a millisecond
            cells = rows[f"{latency} p{pct} ms (added)"]
            assert re.fullmatch(r"\d+\.\d\d", cells[0]), cells
            assert all(re.fullmatch(r"\([+-]\d+\.\d\d\)", cell) for cell in cells[2::2]), cells
        assert rows["ok / failed"][2::3] == ["0"] * 4

    figures = json.loads(out_json.read_text())
    assert figures["nginx"] == re.search(r"^nginx ([\d.]+):", out, re.M).group(1)  # type: ignore[union-attr]
    assert sorted(figures["scenarios"]) == ["a", "b16", "c", "c8", "c8_stream", "one_stream", "one_whole"]
    assert re.fullmatch(r"streamwarden [\w.+-]+ \(compiled: (yes|no)\) from /.+", figures["builds"]["streamwarden"])
    for key, unit in (("a", "event"), ("b16", "event"), ("c", "request"), ("c8", "request"), ("c8_stream", "event")):
        targets = figures["scenarios"][key]["targets"]
        assert figures["scenarios"][key]["void_on_failure"] is key.startswith("c8")
        assert sorted(targets) == ["direct", "floor", "nginx", "streamwarden"]
        assert targets["direct"]["vs_direct"] == 1.0
        assert targets["direct"][f"cpu_us_per_{unit}"] is None
        for name in ("nginx", "floor", "streamwarden"):
            assert targets[name][f"cpu_us_per_{unit}"] > 0
            assert targets[name]["cpu_us_per_request"] > 0
            assert (targets[name]["failed"], targets[name]["void"]) == (0, False)
            assert targets[name]["added_ttfb_p99_ms"] is not None
        assert targets["nginx"]["cpu_vs_nginx"] == 1.0
        assert targets["floor"]["cpu_vs_floor"] == 1.0
    for key in ("a", "b16"):
        assert figures["scenarios"][key]["targets"]["streamwarden"]["ttft_p50_ms"] > 0
    alone = figures["scenarios"]["one_whole"]
    assert (alone["clients"], alone["one_client"], alone["stream"]) == (1, True, False)
    assert alone["targets"]["streamwarden"]["added_total_p99_ms"] is not None
    assert figures["scenarios"]["one_stream"]["targets"]["streamwarden"]["added_ttft_p99_ms"] is not None
    assert sorted(figures["abandon"]) == ["direct", "floor", "nginx", "streamwarden"]
    assert all(r["closes"] + r["ended_first"] == 10 and r["missed"] == 0 for r in figures["abandon"].values())
    assert len(figures["load_average_after"]) == 3


@pytest.mark.timeout(180)  # a subprocess that starts the fake and streamwarden per scenario
def test_bench_reports_b_at_each_stream_count_asked(tmp_path: Path) -> None:
    """--b-streams 64,256,512: a table and figures per count (--quick scales them to 4, 16, 32)."""
    out_json = tmp_path / "bench.json"
    done = _bench("--quick", "--scenarios", "b", "--b-streams", "64,256,512,256", "--json", str(out_json))
    assert done.returncode == 0, done.stdout + done.stderr
    for streams in (4, 16, 32):
        table = _table(done.stdout, f"b: {streams} concurrent streams")
        rows = {line[:22].strip(): line[22:].split() for line in table[3:]}
        assert re.fullmatch(r"[\d.]+", rows["CPU-us per event"][-1]), rows
        assert re.fullmatch(r"\(\+?-?[\d.]+\)", rows["TTFT p99 ms (added)"][-1]), rows
        assert re.fullmatch(r"-?[\d.]+", rows["KB per stream (RSS)"][-1]), rows
    figures = json.loads(out_json.read_text())
    assert sorted(figures["scenarios"]) == ["b16", "b32", "b4"]  # 256 asked twice: measured once
    for key in ("b4", "b16", "b32"):
        streamwarden = figures["scenarios"][key]["targets"]["streamwarden"]
        assert streamwarden["cpu_us_per_event"] > 0
        assert streamwarden["added_ttft_p99_ms"] is not None
        assert streamwarden["kb_per_stream"] is not None


@pytest.mark.timeout(180)  # a subprocess that starts the fake, nginx and streamwarden per scenario
def test_bench_without_nginx_says_so_and_measures_the_rest() -> None:
    """With no nginx on the PATH: one line saying so, and two columns."""
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "nginx").exists())
    done = _bench("--quick", "--scenarios", "c", env={**os.environ, "PATH": path})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "nginx: not on the PATH, so no reference column (apt-get install nginx)" in done.stdout
    table = _table(done.stdout, "c: 8 clients")
    assert re.match(r"^\s+direct\s+floor\s+streamwarden$", table[1]), table
    assert "abandon" not in done.stdout


@pytest.mark.timeout(180)  # a subprocess that starts the fake, the floor and two streamwardens per scenario
def test_bench_compare_measures_another_checkouts_streamwarden_beside(tmp_path: Path) -> None:
    """--compare DIR: a second streamwarden from DIR's own `proxy` package (seen in the header), with its
    own flags, in the same rounds; a label when given, else streamwarden@<the checkout's sha or name>."""
    before = tmp_path / "before"
    shutil.copytree(Path(__file__).parents[2] / "proxy", before / "proxy",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))  # a pure copy, not a git checkout
    out_json = tmp_path / "bench.json"
    done = _bench("--quick", "--scenarios", "c8", "--compare", str(before), "--compare", f"w2={before} --workers=2",
                  "--json", str(out_json))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert f"streamwarden@before: default flags\n  streamwarden 0.1.0 (compiled: no)\n  from {before}\n" in out
    assert f"w2: default flags + --workers=2\n  streamwarden 0.1.0 (compiled: no)\n  from {before}\n" in out
    table = _table(out, "c8: 8 clients, whole")
    assert all(len(line) <= 80 for line in table)
    headers = [line.split() for line in table if line.startswith(" " * 22)]
    assert [name for names in headers for name in names][-3:] == ["streamwarden", "streamwarden@before", "w2"]
    figures = json.loads(out_json.read_text())
    assert figures["builds"]["streamwarden@before"] == f"streamwarden 0.1.0 (compiled: no) from {before}"
    for key in ("c8", "c8_stream"):
        targets = figures["scenarios"][key]["targets"]
        for name in ("streamwarden@before", "w2"):
            assert targets[name]["failed"] == 0
            assert targets[name]["cpu_us_per_request"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rounds", "0"], "--rounds must be at least 1"),
        (["--b-streams", "64,x"], "--b-streams must be numbers"),
        (["--b-streams", "0"], "--b-streams must be from 1 to 4096"),
        (["--scenarios", "a,z"], "--scenarios must be a list of a, b, c, c8, one, abandon"),
        (["--upstream", "ftp://x"], "--upstream must be an http:// or https:// URL"),
        (["--upstream", "http://127.0.0.1:8000/v1"], "--upstream is the backend's root URL, without /v1"),
        (["--compare", "/nonexistent/before"], "--compare: /nonexistent/before is not a streamwarden checkout"),
        (["--compare", ""], "--compare needs a checkout's directory"),
    ],
)
def test_bench_rejects_bad_flags(args: list[str], message: str) -> None:
    done = subprocess.run([PY, "-m", "proxy", "bench", *args], capture_output=True, text=True, timeout=20)
    assert done.returncode == 2
    assert message in done.stderr


@pytest.mark.timeout(180)  # a subprocess that starts the fake, nginx and streamwarden per scenario
def test_bench_upstream_mode_skips_the_abandon_test() -> None:
    """`--upstream URL` in front of a backend that is not the fast fake: direct vs proxied still measured."""
    port = free_port()
    fake = subprocess.Popen([PY, "-m", "proxy", "fake-upstream", "--port", str(port), "--token-rate", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        assert fake.stdout is not None
        assert b"listening on" in fake.stdout.readline()
        done = _bench("--quick", "--scenarios", "c,abandon", "--upstream", f"http://127.0.0.1:{port}")
    finally:
        fake.terminate()
        fake.wait(10)
        if fake.stdout is not None:
            fake.stdout.close()
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"upstream: http://127.0.0.1:{port} (direct vs proxied" in done.stdout
    rows = _table(done.stdout, "c: 8 clients")
    assert re.search(r"^ok / failed(\s+[1-9]\d* / 0){3,4}$", "\n".join(rows), re.M), rows  # nginx too, if there
    assert "abandon test: skipped (it reads the upstream's own view of the close: built-in fake only)" in done.stdout




@pytest.mark.parametrize(("values", "p50", "p99"), [([1.0], 1.0, 1.0), ([float(i) for i in range(1, 101)], 50.0, 99.0)])
def test_percentile_nearest_rank(values: list[float], p50: float, p99: float) -> None:
    assert percentile(values, 50) == p50
    assert percentile(values, 99) == p99
    assert percentile([], 50) is None


def test_table_fits_80_columns_and_shows_the_ratios() -> None:
    scenario = Scenario("b256", "b: 256 concurrent streams, 20 ms per chunk", 256, 2.5, True, 20)
    def window(events: int, cpu: float | None, ttft: float) -> Window:
        return Window(wall=4.0, ok=512, events=events, ttft=[ttft] * 10, ttfe=[ttft] * 10, ttfb=[0.001] * 10,
                      cpu=cpu, rss_idle=40 * 2**20, rss_peak=48 * 2**20, upstream_cpu=1.0, client_cpu=1.0)  # fmt: skip
    per_target = {"direct": [window(53248, None, 0.02)], "nginx": [window(50000, 1.0, 0.021)],
                  "streamwarden": [window(45000, 4.5, 1.52)]}  # fmt: skip
    figures = summarize(scenario, per_target)
    table = format_scenario(scenario, figures)
    assert all(len(line) <= 80 for line in table.splitlines())
    assert figures["streamwarden"]["cpu_us_per_event"] == pytest.approx(100.0)  # 4.5 s / 45,000 events
    assert figures["streamwarden"]["cpu_vs_nginx"] == pytest.approx(5.0)
    assert figures["streamwarden"]["added_ttft_p99_ms"] == pytest.approx(1500.0)
    assert figures["nginx"]["kb_per_stream"] == pytest.approx(32.0)  # 8 MiB over 256 streams
    assert "1520.0 (+1500.0)" in table
    assert "5.00x" in table


def test_one_client_alone_shows_what_it_waits_for_in_hundredths() -> None:
    whole = Scenario("one_whole", "one client alone: whole answers, one after another", 1, 2.0, False, 0,
                     one_client=True)  # fmt: skip
    def window(total: float) -> Window:
        return Window(wall=2.0, ok=1000, ttfb=[total / 2] * 100, total=[total] * 99 + [total * 3], cpu=0.5)
    figures = summarize(whole, {"direct": [window(0.0001)], "nginx": [window(0.0002)],
                                "streamwarden": [window(0.0004)]})  # fmt: skip
    table = format_scenario(whole, figures)
    assert all(len(line) <= 80 for line in table.splitlines())
    assert figures["streamwarden"]["added_total_p50_ms"] == pytest.approx(0.3)
    assert figures["streamwarden"]["added_total_p99_ms"] == pytest.approx(0.3)
    assert "answer p50 ms (added)" in table
    assert "0.40 (+0.30)" in table
    assert "TTFB" not in table  # the whole answer is what a lone client waits for
    assert "KB per stream" not in table


def test_a_saturated_upstream_or_client_is_named_under_the_table() -> None:
    scenario = Scenario("a", "a: 32 clients, streams of 100 chunks, no delay", 32, 2.0, True, 0)
    busy = Window(wall=1.0, ok=384, events=39936, cpu=0.5, upstream_cpu=0.95, client_cpu=0.2)
    calm = Window(wall=1.0, ok=384, events=39936, cpu=0.5, upstream_cpu=0.5, client_cpu=0.9)
    table = format_scenario(scenario, summarize(scenario, {"direct": [busy], "streamwarden": [calm]}))
    assert "note: the upstream used 95% of a core against direct: it may be the limit" in table
    assert "note: this client used 90% of a core against streamwarden" in table
    assert "the upstream used 50%" not in table


def test_a_void_window_gives_no_cpu_figure_and_says_void() -> None:
    """OnTheBench's rule: one failed request in any round voids the target's CPU figure (not a median of the rest)."""
    scenario = Scenario("c8", "c8: 8 clients, whole answers; CPU per request, void on any failure", 8, 2.0, False, 0,
                        void_on_failure=True)  # fmt: skip
    clean, failed = Window(wall=2.0, ok=1000, cpu=0.1), Window(wall=2.0, ok=999, failed=1, cpu=0.1)
    per_target = {"direct": [Window(wall=2.0, ok=3000)], "nginx": [clean, clean], "floor": [clean, clean],
                  "streamwarden": [clean, failed]}  # fmt: skip
    figures = summarize(scenario, per_target)
    assert figures["nginx"]["cpu_us_per_request"] == pytest.approx(100.0)
    assert figures["floor"]["cpu_vs_floor"] == pytest.approx(1.0)
    assert (figures["streamwarden"]["void"], figures["streamwarden"]["cpu_us_per_request"]) == (True, None)
    rows = {line[:22].strip(): line[22:].split() for line in format_scenario(scenario, figures).splitlines()[4:]}
    assert rows["CPU-us per request"] == ["-", "100.0", "100.0", "void"]
    assert rows["vs floor"] == ["-", "1.00x", "1.00x", "void"]
    lenient = Scenario("c", "c: 8 clients, non-streaming", 8, 2.0, False, 0)
    assert summarize(lenient, per_target)["streamwarden"]["cpu_us_per_request"] == pytest.approx(100.05)


def test_columns_past_80_go_on_in_another_block_with_their_header() -> None:
    scenario = Scenario("b512", "b: 512 concurrent streams, 20 ms per chunk", 512, 0, True, 20)
    names = ["direct", "nginx", "floor", "streamwarden", "streamwarden@0123abc", "w2"]
    window = Window(wall=4.0, ok=1024, events=106496, ttft=[1.52] * 10, ttfe=[1.52] * 10, ttfb=[0.001] * 10, cpu=1.0)
    table = format_scenario(scenario, summarize(scenario, {name: [window] for name in names})).splitlines()
    assert all(len(line) <= 80 for line in table)
    headers = [line.split() for line in table if line.startswith(" " * 22)]
    assert len(headers) == 2
    assert headers[0][0] == "direct"
    assert [name for names in headers for name in names] == names
    assert len([line for line in table if line.startswith("CPU-us per event")]) == 2
