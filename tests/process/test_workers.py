"""`serve --workers 2` as a user runs it: one supervisor, two workers on one port, one admin port.

Real processes, real clients on fresh connections (so SO_REUSEPORT spreads them over both workers),
the in-process fake upstream. The aggregated /metrics must equal what the clients did, exactly as
one process would count it; a worker killed with SIGKILL is replaced without a counter going back;
SIGTERM drains every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import FakeUpstream
from support.contract import ABORT_PHASES, APIS, CANCEL_HOOK_FAILURE_REASONS, CANCELLATION_REASONS, REWRITE_REASONS
from support.hostile import PY, WAIT, ServeProcess, until
from support.metrics import Exposition, body_for, check_label_values
from support.ports import free_port

from proxy.config import Config
from proxy.observe.logs import make_logger
from proxy.server.admin import build_admin_app
from proxy.server.app import build_state
from proxy.workers.supervisor import Supervisor

TOKENS = 16  # the fake's default answer: 16 content events
CHAT = "/v1/chat/completions"


@contextlib.asynccontextmanager
async def workers(upstream: str, *flags: str, env: dict[str, str] | None = None) -> AsyncIterator[ServeProcess]:
    proc = ServeProcess(upstream, "--workers", "2", *flags, env=env)
    try:
        await until(lambda: len(proc.lines("worker_ready")) >= 2)
        yield proc
    finally:
        proc.stop()
    if proc.proc.returncode == 0:  # every clean exit removes the metrics directory
        assert not exists(proc.lines("started")[0]["metrics_dir"])


def fresh() -> aiohttp.ClientSession:
    """A client whose every request opens its own connection (a new source port: a new SO_REUSEPORT pick)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def scrape(proc: ServeProcess) -> Exposition:
    async with fresh() as http, http.get(f"{proc.admin_url}/metrics") as resp:
        assert resp.status == 200
        return Exposition(await resp.text())


async def readyz(proc: ServeProcess) -> tuple[int, dict[str, Any]]:
    async with fresh() as http, http.get(f"{proc.admin_url}/readyz") as resp:
        return resp.status, await resp.json()


async def ok_stream(http: aiohttp.ClientSession, proc: ServeProcess, rid: str) -> dict[str, int]:
    """A whole chat stream with usage; returns the usage the client received."""
    body = body_for("chat_completions", stream=True, usage=True)
    usage: dict[str, int] = {}
    async with http.post(proc.url + CHAT, json=body, headers={"X-Request-Id": rid}) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunk = orjson.loads(line[6:])
                usage = chunk.get("usage") or usage
    assert usage["completion_tokens"] == TOKENS
    return usage


async def failing(http: aiohttp.ClientSession, proc: ServeProcess, rid: str) -> None:
    body = body_for("chat_completions", stream=True)
    async with http.post(proc.url + CHAT, json=body, headers={"X-Request-Id": rid, "x-fault": "upstream_429"}) as resp:
        assert resp.status == 429
        await resp.read()


async def open_slow(http: aiohttp.ClientSession, proc: ServeProcess, rid: str, *, events: int = 2,
                    rate: int = 20) -> aiohttp.ClientResponse:
    """A slow stream, read until `events` content events arrived; the caller closes it."""
    headers = {"X-Request-Id": rid, "x-fault": f"slow;rate={rate};tokens=1000"}
    resp = await http.post(proc.url + CHAT, json=body_for("chat_completions", stream=True), headers=headers)
    assert resp.status == 200
    seen = 0
    async with asyncio.timeout(WAIT):
        while seen < events:
            event = await resp.content.readuntil(b"\n\n")
            seen += b'"content":"' in event and b'"content":""' not in event
    return resp


async def booked(proc: ServeProcess, count: int) -> None:
    """Wait until `count` requests are booked (their log lines written)."""
    await until(lambda: len(proc.lines()) >= count)


def exists(path: str) -> bool:
    return os.path.exists(path)


def running(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def files_of(directory: str, pid: int) -> list[Path]:
    return list(Path(directory).glob(f"*_{pid}.db"))


def children_of(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()


def pids(proc: ServeProcess, event: str) -> set[int]:
    return {line["pid"] for line in proc.lines(event)}


async def test_aggregated_metrics_equal_what_the_clients_did(fake_upstream: FakeUpstream) -> None:
    async with workers(fake_upstream.url) as proc:
        async with fresh() as http:
            usages = await asyncio.gather(*(ok_stream(http, proc, f"ok-{i}") for i in range(12)))
            await asyncio.gather(*(failing(http, proc, f"err-{i}") for i in range(6)))
            slow = await asyncio.gather(*(open_slow(http, proc, f"gone-{i}") for i in range(6)))
            for resp in slow:
                resp.close()
            await until(lambda: len(proc.lines()) == 24)
        lines = proc.lines()
        metrics = await scrape(proc)

    assert pids(proc, "request") == pids(proc, "worker_ready")  # both workers served
    assert len(pids(proc, "request")) == 2
    assert {line["worker"] for line in lines} == {0, 1}
    assert metrics.total("streamwarden_requests_total", ("outcome", "reason")) == {
        ("ok", "complete"): 12, ("error", "upstream_4xx"): 6, ("aborted", "client_disconnect"): 6,
    }
    assert metrics.total("streamwarden_upstream_responses_total", ("code",)) == {("200",): 18, ("429",): 6}
    assert metrics.value("streamwarden_upstream_cancellations_total", api="chat_completions",
                         reason="client_disconnect") == 6
    tokens = metrics.total("streamwarden_tokens_total", ("kind", "source"))
    estimated = sum(line["completion_tokens"] for line in lines if line["outcome"] == "aborted")
    assert estimated >= 12  # each abandoned stream had delivered two content events at least
    assert tokens == {
        ("prompt", "usage"): sum(u["prompt_tokens"] for u in usages),
        ("completion", "usage"): sum(u["completion_tokens"] for u in usages),
        ("completion", "estimated"): estimated,
    }
    assert metrics.total("streamwarden_aborts_total", ("phase",)) == {
        **{(phase,): 0 for phase in ABORT_PHASES}, ("mid_stream",): 6,
    }
    assert metrics.value("streamwarden_request_duration_seconds_count", api="chat_completions", outcome="ok") == 12
    ttft = sum(1 for line in lines if line["ttft_ms"] is not None)
    assert metrics.value("streamwarden_time_to_first_token_seconds_count", api="chat_completions", model="m") == ttft
    assert metrics.value("streamwarden_inter_token_latency_seconds_count", api="chat_completions") == 12 * (TOKENS - 1)
    assert metrics.value("streamwarden_time_per_output_token_seconds_count", api="chat_completions") == 12
    assert metrics.total("streamwarden_inflight_requests", ("api",)) == {(api,): 0 for api in APIS}
    assert metrics.value("streamwarden_upstream_up") == 1
    assert len(metrics.series("streamwarden_build_info")) == 1
    # The series that alerts take increase() of exist at 0, once each, as with one process.
    for api in APIS:
        for name, reasons in (("streamwarden_stream_rewrites_total", REWRITE_REASONS),
                              ("streamwarden_upstream_cancellations_total", CANCELLATION_REASONS),
                              ("streamwarden_cancel_hook_failures_total", CANCEL_HOOK_FAILURE_REASONS)):
            for reason in reasons:
                assert len([s for s in metrics.series(name) if s.labels == {"api": api, "reason": reason}]) == 1
    assert check_label_values(metrics) > 0
    assert not any("pid" in sample.labels for sample in metrics.samples())


async def test_the_families_are_those_of_one_process(fake_upstream: FakeUpstream) -> None:
    one = ServeProcess(fake_upstream.url, "--workers", "1")
    try:
        async with fresh() as http:
            await ok_stream(http, one, "single")
        await until(lambda: len(one.lines()) == 1)
        single = await scrape(one)
        children = children_of(one.pid)
        started = one.lines("started")[0]
    finally:
        one.stop()
    assert children == []  # --workers 1 is the process model of before: no supervisor, no workers
    assert "metrics_dir" not in started
    assert "worker" not in one.lines()[0]
    async with workers(fake_upstream.url) as proc:
        async with fresh() as http:
            await ok_stream(http, proc, "pair")
        await until(lambda: len(proc.lines()) == 1)
        pair = await scrape(proc)

    def shape(exposition: Exposition) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
        return {(s.name, tuple(sorted(s.labels.items()))) for s in exposition.samples()}

    assert shape(pair) == shape(single)
    kinds = {f.name: f.type for f in text_string_to_metric_families(single.text)}
    assert {f.name: f.type for f in text_string_to_metric_families(pair.text) if f.samples} == {
        name: kind for name, kind in kinds.items() if single.families[name].samples
    }


async def alive(resp: aiohttp.ClientResponse) -> bool:
    """Whether a held stream still runs: three more content events come, or its connection ends."""
    try:
        seen = 0
        async with asyncio.timeout(WAIT):
            while seen < 3:
                event = await resp.content.readuntil(b"\n\n")
                seen += b'"content":"' in event and b'"content":""' not in event
    except (aiohttp.ClientError, asyncio.IncompleteReadError):
        return False
    return True


async def test_a_killed_worker_is_replaced_and_no_counter_goes_back(fake_upstream: FakeUpstream) -> None:
    held = 20
    async with workers(fake_upstream.url) as proc:
        async with fresh() as http:
            await asyncio.gather(*(ok_stream(http, proc, f"before-{i}") for i in range(8)))
            slow = await asyncio.gather(*(open_slow(http, proc, f"held-{i}") for i in range(held)))
            assert (await scrape(proc)).value("streamwarden_inflight_requests", api="chat_completions") == held
            victim = proc.lines("worker_ready")[0]
            os.kill(victim["pid"], signal.SIGKILL)
            exited = await proc.line(lambda line: line["pid"] == victim["pid"], "worker_exited")
            assert exited["worker"] == victim["worker"]
            assert exited["exit"] == "SIGKILL"
            replacement = await proc.line(
                lambda line: line["worker"] == victim["worker"] and line["pid"] != victim["pid"], "worker_ready",
            )
            assert await readyz(proc) == (200, {"status": "ready", "upstream_up": True})
            # The dead worker's files are folded into the supervisor's; its counts stay (checked below).
            assert not files_of(proc.lines("started")[0]["metrics_dir"], victim["pid"])
            survivors = sum(await asyncio.gather(*(alive(resp) for resp in slow)))
            assert 0 < survivors < held  # both workers held streams (20 connections: all on one is 2^-19)
            for resp in slow:
                resp.close()
            # The killed worker's streams left no log line; the survivor's leave as aborted.
            await until(lambda: sum(1 for line in proc.lines() if line["outcome"] == "aborted") == survivors)
            await asyncio.gather(*(ok_stream(http, proc, f"after-{i}") for i in range(16)))
            await until(lambda: sum(1 for line in proc.lines() if line["request_id"].startswith("after-")) == 16)
        metrics = await scrape(proc)
    assert metrics.total("streamwarden_requests_total", ("outcome",)) == {("ok",): 8 + 16, ("aborted",): survivors}
    ok = {"api": "chat_completions", "outcome": "ok"}
    assert metrics.value("streamwarden_request_duration_seconds_count", **ok) == 8 + 16
    assert metrics.value("streamwarden_request_duration_seconds_bucket", **ok, le="+Inf") == 8 + 16
    assert metrics.value("streamwarden_inter_token_latency_seconds_count", api="chat_completions") == 24 * (TOKENS - 1)
    usage = metrics.total("streamwarden_tokens_total", ("source", "kind"))
    assert usage[("usage", "completion")] == 24 * TOKENS
    # The killed worker's in-flight streams left with it (livesum over live workers), not stuck at its share.
    assert metrics.value("streamwarden_inflight_requests", api="chat_completions") == 0
    assert all(line["pid"] != victim["pid"] for line in proc.lines() if line["outcome"] == "aborted")
    after_pids = {line["pid"] for line in proc.lines() if line["request_id"].startswith("after-")}
    assert replacement["pid"] in after_pids


async def test_sigterm_drains_every_worker(fake_upstream: FakeUpstream) -> None:
    drain = 1.0
    async with workers(fake_upstream.url, "--drain-timeout", str(drain)) as proc:
        metrics_dir = proc.lines("started")[0]["metrics_dir"]
        assert exists(metrics_dir)
        worker_pids = pids(proc, "worker_ready")
        async with fresh() as http:  # 20 connections: all on one worker is 2^-19
            slow = await asyncio.gather(*(open_slow(http, proc, f"s-{i}", events=1, rate=10) for i in range(20)))
            proc.signal(signal.SIGTERM)
            status, body = await readyz(proc)
            assert (status, body["status"]) == (503, "draining")

            async def rest(resp: aiohttp.ClientResponse) -> bytes:
                async with asyncio.timeout(WAIT):
                    return await resp.read()

            tails = await asyncio.gather(*(rest(resp) for resp in slow))
        await until(lambda: proc.proc.poll() is not None, within=drain + 1 + 5)
        assert proc.proc.returncode == 0
    for tail in tails:
        assert b'"content":"' in tail  # the stream ran on after SIGTERM
        assert b'"code":"shutdown"' in tail
        assert tail.endswith(b"data: [DONE]\n\n")
    lines = proc.lines()
    assert len(lines) == 20
    assert {line["reason"] for line in lines} == {"shutdown"}
    assert {line["pid"] for line in lines} == worker_pids
    assert proc.lines("stopped")
    assert not proc.lines("worker_exited")  # a drain is not a death: nothing is restarted
    assert not exists(metrics_dir)
    for pid in worker_pids:
        assert not running(pid)


async def test_a_second_sigterm_ends_the_drain_of_every_worker(fake_upstream: FakeUpstream) -> None:
    async with workers(fake_upstream.url, "--drain-timeout", "600") as proc:
        metrics_dir = proc.lines("started")[0]["metrics_dir"]
        async with fresh() as http:  # 20 connections: all on one worker is 2^-19
            slow = await asyncio.gather(*(open_slow(http, proc, f"s-{i}", events=1) for i in range(20)))
            proc.signal(signal.SIGTERM)
            await proc.line(lambda line: True, "draining")
            proc.signal(signal.SIGTERM)
            tails = await asyncio.gather(*(asyncio.wait_for(resp.read(), WAIT) for resp in slow))
        await until(lambda: proc.proc.poll() is not None)  # far sooner than the 600 s drain
        assert proc.proc.returncode == 0  # the supervisor passed the second signal on, and was not killed by it
    assert all(b'"code":"shutdown"' in tail for tail in tails)
    assert len({line["pid"] for line in proc.lines()}) == 2
    assert len(proc.lines("stopped")) == 3  # two workers and the supervisor
    assert not exists(metrics_dir)


@pytest.mark.parametrize(("reuse_port", "which"), [(False, "--port"), (True, "--port"), (False, "--admin-port")],
                         ids=["another program", "another reuse-port set", "the admin port"])
def test_a_taken_port_stops_the_supervisor_with_one_line(reuse_port: bool, which: str) -> None:
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, int(reuse_port))
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        other = "--admin-port" if which == "--port" else "--port"
        ports = {which: port, other: free_port()}  # `port` is held: free_port() cannot return it
        env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMWARDEN_")}
        done = subprocess.run(
            [PY, "-m", "proxy", "serve", "--upstream", "http://127.0.0.1:9", "--host", "127.0.0.1",
             *(str(part) for item in ports.items() for part in item), "--workers", "2"],
            capture_output=True, text=True, timeout=WAIT, env=env,
        )
    assert done.returncode == 2  # a start-up failure, like a bad flag
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"streamwarden serve: cannot listen on 127.0.0.1:{port} ({which}): address already in use"
    ]


@pytest.mark.parametrize(("ready", "status"), [((1, 2), 503), ((2, 2), 200)])
async def test_readyz_needs_every_worker(
    fake_upstream: FakeUpstream, aiohttp_client: Any, ready: tuple[int, int], status: int,
) -> None:
    from proxy.server.app import open_upstream_session

    state = build_state(Config(upstream=fake_upstream.url))
    state.session = open_upstream_session(state.config)
    try:
        client = await aiohttp_client(build_admin_app(state, lambda: ready))
        async with client.get("/readyz") as resp:
            assert resp.status == status
            body = await resp.json()
    finally:
        await state.session.close()
    if status == 503:
        assert body == {"status": "workers not ready", "upstream_up": True, "workers_ready": 1, "workers": 2}


async def test_model_labels_are_bounded_for_the_set(fake_upstream: FakeUpstream) -> None:
    """One --model-label-limit for all workers, and the upstream's own names (learned by the supervisor's
    probe) keep their label in every worker."""
    async with workers(fake_upstream.url, "--model-label-limit", "2") as proc:
        await scrape(proc)  # the probe learns the upstream's `fake-model` and passes it on to the workers
        await until(lambda: len(proc.lines("upstream_models")) == 2)
        async with fresh() as http:
            for i in range(8):
                body = {**body_for("chat_completions", stream=False), "model": f"junk-{i}"}
                async with http.post(proc.url + CHAT, json=body) as resp:
                    assert resp.status == 200
                # A worker books (and claims the label) as its handler unwinds, after the client has its
                # answer: wait for the booking, or the next request's worker may claim a label first.
                await booked(proc, i + 1)
            for _ in range(8):
                body = {**body_for("chat_completions", stream=False), "model": "fake-model"}
                async with http.post(proc.url + CHAT, json=body) as resp:
                    assert resp.status == 200
        await until(lambda: len(proc.lines()) == 16)
        metrics = await scrape(proc)
    assert len(pids(proc, "request")) == 2
    assert metrics.total("streamwarden_requests_total", ("model",)) == {
        ("junk-0",): 1, ("junk-1",): 1, ("other",): 6, ("fake-model",): 8,
    }


async def test_workers_leave_when_the_supervisor_is_killed(fake_upstream: FakeUpstream, tmp_path: Path) -> None:
    # Its own TMPDIR: any supervisor that starts on this machine meanwhile (another test run's) removes
    # the directory of a killed one from the shared /tmp, as it should.
    async with workers(fake_upstream.url, "--drain-timeout", "0", env={"TMPDIR": str(tmp_path)}) as proc:
        worker_pids = pids(proc, "worker_ready")
        metrics_dir = proc.lines("started")[0]["metrics_dir"]
        proc.signal(signal.SIGKILL)
        await until(lambda: not any(running(pid) for pid in worker_pids))
        assert {line["pid"] for line in proc.lines("stopped")} == worker_pids  # each drained and said so
    assert exists(metrics_dir)  # a supervisor killed with SIGKILL cannot remove it (documented)
    shutil.rmtree(metrics_dir)


def _supervisor(fake: FakeUpstream, directory: str, worker: str) -> tuple[Supervisor, io.StringIO]:
    log = io.StringIO()
    config = Config(upstream=fake.url, host="127.0.0.1", port=0, admin_port=0, workers=2)
    return Supervisor(config, directory, worker_argv=[PY, "-c", worker], logger=make_logger(stream=log)), log


def _logged(log: io.StringIO, event: str) -> list[dict[str, Any]]:
    return [line for line in map(orjson.loads, log.getvalue().splitlines()) if line["event"] == event]


_READ_BOOT = "import os, struct, sys; n, = struct.unpack('!I', sys.stdin.buffer.read(4)); sys.stdin.buffer.read(n); "


async def test_workers_that_never_come_up_stop_the_supervisor(fake_upstream: FakeUpstream, tmp_path: Path) -> None:
    supervisor, log = _supervisor(fake_upstream, str(tmp_path), _READ_BOOT + "sys.exit(3)")
    async with asyncio.timeout(WAIT):
        assert await supervisor.run() == 1
    failed = _logged(log, "worker_failed")
    assert failed
    assert failed[0]["exit"] == "code 3"
    assert not _logged(log, "worker_exited")  # not retried: a worker that cannot start will not start later


async def test_workers_that_keep_dying_are_restarted_with_a_back_off(
    fake_upstream: FakeUpstream, tmp_path: Path,
) -> None:
    supervisor, log = _supervisor(fake_upstream, str(tmp_path), _READ_BOOT + "os.write(1, b'ready\\n'); sys.exit(5)")
    run = asyncio.ensure_future(supervisor.run())
    try:
        await until(lambda: sum(1 for line in _logged(log, "worker_exited") if line["worker"] == 0) >= 3)
    finally:
        supervisor.request_stop()
        async with asyncio.timeout(WAIT):
            assert await run == 0
    exits = [line for line in _logged(log, "worker_exited") if line["worker"] == 0]
    assert {line["exit"] for line in exits} == {"code 5"}
    delays = [line["restart_in_s"] for line in exits[:3]]
    assert delays == [0.1, 0.2, 0.4]
    assert len({line["pid"] for line in exits}) == len(exits)


async def test_a_hung_worker_is_killed_and_replaced(fake_upstream: FakeUpstream) -> None:
    """A SIGSTOPped worker keeps its accept queue; only its silence tells.

    Before: the supervisor reacted to exits only; /readyz said 200 and 8 of 20 new requests hung.
    """
    async with workers(fake_upstream.url) as proc:
        victim = proc.lines("worker_ready")[0]
        os.kill(victim["pid"], signal.SIGSTOP)
        try:
            async with asyncio.timeout(WAIT):  # /readyz turns 503 once the silence is noticed
                while (await readyz(proc))[0] != 503:  # noqa: ASYNC110 - another process: polled
                    await asyncio.sleep(0.02)
            hung = await proc.line(lambda line: line["pid"] == victim["pid"], "worker_hung")
            assert hung["worker"] == victim["worker"]
            exited = await proc.line(lambda line: line["pid"] == victim["pid"], "worker_exited")
            assert exited["exit"] == "SIGKILL"
            await proc.line(lambda line: line["worker"] == victim["worker"] and line["pid"] != victim["pid"],
                            "worker_ready")
            assert await readyz(proc) == (200, {"status": "ready", "upstream_up": True})
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim["pid"], signal.SIGCONT)
        async with fresh() as http:
            async with asyncio.timeout(WAIT):
                await asyncio.gather(*(ok_stream(http, proc, f"after-hang-{i}") for i in range(20)))
