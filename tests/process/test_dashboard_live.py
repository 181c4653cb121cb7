"""Every dashboard and alert expression, run by a real Prometheus against a live proxy.

promtool (test_prometheus_rules.py) proves the expressions parse; only a real scrape proves that they
select series the proxy actually exports, with the labels and types it exports them with. A proxy in
front of the fake upstream serves ok, error and aborted traffic; a Prometheus subprocess scrapes its
admin port every second; after a few scrapes and a second round of traffic (so that rates are not
zero), each expression goes through `/api/v1/query`. A dashboard panel must return data with at least
one finite value (a panel of NaN draws nothing); an alert expression must run, and with its threshold
turned into a `bool` comparison it must return data too (so its selectors match live series).
"""

from __future__ import annotations

import asyncio
import math
import re
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from support import FakeUpstream, Proxy, ProxyFactory
from support.metrics import PATHS, abandon, answered, body_for, call, leave_when
from support.ports import free_port
from support.promql_exprs import dashboard_exprs, rule_exprs

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus binary is not on PATH (Debian: apt-get install "
                       "prometheus)"),
]

SCRAPE_SECONDS = 1
WAIT_SECONDS = 20.0
_THRESHOLD = re.compile(r"(>=|<=|==|!=|>|<)\s*([-+]?\d+(?:\.\d+)?)\s*$")


def prometheus_config(admin_url: str) -> dict[str, Any]:
    target = admin_url.removeprefix("http://")
    return {
        "global": {"scrape_interval": f"{SCRAPE_SECONDS}s", "evaluation_interval": f"{SCRAPE_SECONDS}s"},
        "scrape_configs": [{
            "job_name": "streamwarden",
            "scrape_interval": f"{SCRAPE_SECONDS}s",
            "scrape_timeout": f"{SCRAPE_SECONDS}s",
            "metrics_path": "/metrics",
            # What the Kubernetes job's relabelling adds, so `by (pod)` and `by (namespace, ...)` have values.
            "static_configs": [{"targets": [target], "labels": {"pod": "streamwarden-0", "namespace": "test"}}],
        }],
    }


async def drive(http: aiohttp.ClientSession, proxy: Proxy, fake: FakeUpstream, round_: str) -> None:
    """Ok, error and aborted exchanges (an abort at each phase), with usage and estimated tokens, streams
    and whole bodies."""
    chat = "chat_completions"
    script: list[tuple[str, str, dict[str, Any]]] = [
        ("usage", chat, {"stream": True, "usage": True}),
        ("estimated", chat, {"stream": True}),
        ("paced", chat, {"stream": True, "fault": "slow;rate=20;tokens=6"}),  # gaps of about 50 ms
        ("responses", "responses", {"stream": True}),
        ("messages-whole", "messages", {}),
        ("cut", chat, {"stream": True, "fault": "cut"}),
        ("stray", chat, {"stream": True, "fault": "stray_503"}),
        ("stall", "completions", {"stream": True, "fault": "stall"}),
        ("rate-limited", "completions", {"fault": "upstream_429"}),
        ("malformed", chat, {"stream": True, "fault": "malformed_event"}),
    ]
    for rid, api, kw in script:
        await call(http, proxy, fake, f"{round_}-{rid}", api, **kw)
    await abandon(http, proxy, fake, f"{round_}-abandoned", chat, content_events=1)  # mid_stream
    stream = body_for(chat, stream=True)
    rid = f"{round_}-gave-up-waiting"
    await leave_when(http, proxy, rid, PATHS[chat], stream, lambda ex: fake.recorder.get(rid) is not None,
                     {"x-fault": "late_headers;delay=60"})  # before_headers
    await leave_when(http, proxy, f"{round_}-held", PATHS[chat], stream, answered,
                     {"x-fault": "stall;after=1;hold=60"})  # before_first_token
    await leave_when(http, proxy, f"{round_}-whole", PATHS[chat], body_for(chat, stream=False), answered,
                     {"x-fault": "slow_body;delay=60"})  # whole_body


class PromAPI:
    def __init__(self, http: aiohttp.ClientSession, port: int, log: Path) -> None:
        self.http = http
        self.base = f"http://127.0.0.1:{port}"
        self.log = log

    def output(self) -> str:
        return self.log.read_text()[-3000:]

    async def query(self, expr: str) -> list[dict[str, Any]]:
        async with self.http.get(f"{self.base}/api/v1/query", params={"query": expr}) as resp:
            body = await resp.json()
        assert resp.status == 200, f"{expr!r}: {body}"
        assert body["status"] == "success", f"{expr!r}: {body}"
        assert body["data"]["resultType"] == "vector", expr
        return list(body["data"]["result"])

    async def scalar(self, expr: str) -> float:
        result = await self.query(expr)
        return float(result[0]["value"][1]) if result else 0.0

    async def ready(self) -> None:
        for _ in range(int(WAIT_SECONDS / 0.1)):
            try:
                async with self.http.get(f"{self.base}/-/ready") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.1)
        raise AssertionError(f"Prometheus did not become ready:\n{self.output()}")

    async def until(self, expr: str, wanted: float) -> None:
        """Poll (bounded) until `expr` reaches `wanted`: a scrape has brought what the test waits for."""
        value = 0.0
        for _ in range(int(WAIT_SECONDS / 0.2)):
            value = await self.scalar(expr)
            if value >= wanted:
                return
            await asyncio.sleep(0.2)
        async with self.http.get(f"{self.base}/api/v1/targets") as resp:
            targets = await resp.json()
        raise AssertionError(f"{expr} stayed at {value} < {wanted}; targets: {targets}\n{self.output()}")


def finite(result: list[dict[str, Any]]) -> list[float]:
    values = [float(series["value"][1]) for series in result]
    return [v for v in values if math.isfinite(v)]


async def test_every_dashboard_and_alert_expression_on_live_data(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    assert PROMETHEUS is not None
    proxy = await make_proxy(idle_timeout=0.3)
    await drive(http, proxy, fake_upstream, "first")

    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(proxy.admin_url)))
    log_path = tmp_path / "prometheus.log"
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
        try:
            prom = PromAPI(http, port, log_path)
            await prom.ready()
            await prom.until("count_over_time(streamwarden_build_info[1m])", 3)
            assert await prom.scalar('up{job="streamwarden"}') == 1
            # Traffic between scrapes: every rate over the short history is then above zero.
            await drive(http, proxy, fake_upstream, "second")
            total = sum(s.value for m in proxy.state.metrics.registry.collect() for s in m.samples
                        if s.name == "streamwarden_requests_total")
            assert total == 28
            await prom.until("sum(streamwarden_requests_total)", total)
            await check_expressions(prom)
        finally:
            if process.returncode is None:
                process.terminate()
                try:
                    await asyncio.wait_for(process.wait(), 10)
                except TimeoutError:
                    process.kill()
                    await process.wait()


async def check_expressions(prom: PromAPI) -> None:
    everything = dashboard_exprs()
    # The backend's own series (vllm:*, llamacpp:*) come from job llm-backend, which this proxy in front
    # of the fake upstream has none of: those queries must run; test_prometheus_rules.py checks their names.
    backend = [e for e in everything if re.search(r"\b(vllm|llamacpp):", e)]
    panels = [e for e in everything if e not in backend]
    rules = rule_exprs()
    assert len(panels) >= 19
    assert len(backend) >= 5
    assert len(rules) >= 8
    for expr in backend:
        await prom.query(expr)
    for expr in panels:
        result = await prom.query(expr)
        assert result, f"dashboard query returned no data: {expr}"
        assert finite(result), f"dashboard query returned only NaN: {expr} -> {result}"
    for expr in rules:
        await prom.query(expr)  # it runs; whether it fires is the thresholds' business
        comparison = _THRESHOLD.search(expr)
        assert comparison is not None, f"alert expression without a trailing threshold: {expr}"
        as_bool = _THRESHOLD.sub(r"\1 bool \2", expr)
        assert await prom.query(as_bool), f"alert expression selects no live series: {as_bool}"

    # A few values the mix fixes, to be sure the panels show this traffic and not just something.
    by_outcome = await prom.query(panels[0])
    assert panels[0].startswith("sum by (outcome)")
    assert {series["metric"]["outcome"] for series in by_outcome} == {"ok", "error", "aborted"}
    assert await prom.scalar('max by (pod) (streamwarden_upstream_up{pod="streamwarden-0"})') == 1
    assert await prom.scalar('sum(streamwarden_inflight_requests)') == 0
    for histogram in ("streamwarden_time_to_first_token_seconds", "streamwarden_request_duration_seconds"):
        p95 = await prom.scalar(f"histogram_quantile(0.95, sum by (le) (rate({histogram}_bucket[1m])))")
        assert 0 < p95 < 5, (histogram, p95)

    # The dashboard's latency and abort panels, on this traffic (printed with -s: what each panel shows).
    itl = {q: await prom.scalar(_quantile(q, "streamwarden_inter_token_latency_seconds")) for q in ("0.50", "0.95")}
    tpot = {q: await prom.scalar(_quantile(q, "streamwarden_time_per_output_token_seconds")) for q in ("0.50", "0.95")}
    wait = {q: await prom.scalar(_quantile(q, "streamwarden_abort_wait_seconds")) for q in ("0.50", "0.95")}
    by_phase = {s["metric"]["phase"]: float(s["value"][1]) for s in await prom.query(
        'sum by (phase) (rate(streamwarden_aborts_total[1m]))')}
    error_ratio = {s["metric"]["api"]: float(s["value"][1]) for s in await prom.query(
        next(e for e in panels if "code=~" in e))}
    print(f"\nITL {itl}\nTPOT {tpot}\nabort wait {wait}\naborts/s by phase {by_phase}\nerror ratio {error_ratio}")
    for quantiles in (itl, tpot, wait):
        assert 0 < quantiles["0.50"] <= quantiles["0.95"] < 60, quantiles
    assert set(by_phase) == {"before_headers", "before_first_token", "mid_stream", "whole_body"}
    assert all(rate > 0 for rate in by_phase.values()), by_phase
    # completions: the stall (a server error) and the 429 (the backend is full) both count; with the
    # 4xx exclusion alone the 429 would not.
    assert error_ratio["completions"] == 1.0
    assert 0 < error_ratio["chat_completions"] < 1


def _quantile(q: str, histogram: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket[1m])))"
