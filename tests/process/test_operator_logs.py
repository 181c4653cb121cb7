"""What an operator's log shows at `--log-level warning`, and a scrape of the backend's own
`/metrics` through the main port, both through a real `streamwarden serve` process and the real fake.

At warning, production's usual level, every failure is still there (with what the backend said) and
every success is gone; started, draining and stopped survive. A Prometheus scrape of the backend
through the proxy is forwarded but is neither counted as model traffic nor logged above debug.
"""

from __future__ import annotations

import signal
from typing import Any

import aiohttp
import orjson
import pytest
from support.hostile import WAIT, FakeProcess, ServeProcess

from proxy.observe.books import log_level
from proxy.server.serve import DRAINING_HINT

CHAT = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("outcome", "reason", "level"),
    [
        ("ok", "complete", "info"),
        ("aborted", "client_disconnect", "info"),
        ("error", "upstream_4xx", "warning"),
        ("error", "stream_cut", "warning"),
        ("error", "proxy_error", "error"),
    ],
)
def test_the_level_of_a_request_line_follows_its_outcome(outcome: str, reason: str, level: str) -> None:
    assert log_level(outcome, reason) == level


async def _post(http: aiohttp.ClientSession, url: str, request_id: str, fault: str | None = None) -> tuple[int, Any]:
    headers = {"X-Request-Id": request_id, **({"x-fault": fault} if fault else {})}
    async with http.post(url + "/v1/chat/completions", json=CHAT, headers=headers) as resp:
        body = await resp.read()
        return resp.status, body


async def test_warning_keeps_every_failure_with_the_upstreams_message_and_drops_the_successes(
    fake: FakeProcess,
) -> None:
    proxy = ServeProcess(fake.url, "--log-level", "warning", "--hold-headers", "0")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT)) as http:
            status, body = await _post(http, proxy.url, "fine")
            assert status == 200
            assert body.endswith(b"data: [DONE]\n\n")
            status, body = await _post(http, proxy.url, "not-found", "upstream_4xx_native;status=404")
            assert status == 404
            client_message = orjson.loads(body)["error"]["message"]
            status, body = await _post(http, proxy.url, "stray", "stray_503;after=3")
            assert status == 200
            assert b"engine overloaded" in body
        not_found = await proxy.line(lambda line: line["request_id"] == "not-found")
        stray = await proxy.line(lambda line: line["request_id"] == "stray")
        proxy.signal(signal.SIGINT)
        assert proxy.proc.wait(timeout=WAIT) == 0
    finally:
        proxy.stop()
    assert (not_found["level"], not_found["reason"]) == ("warning", "upstream_4xx")
    assert not_found["upstream_message"] == client_message, "the log says what the backend said"
    assert (stray["level"], stray["reason"]) == ("warning", "stray_http_block")
    assert "engine overloaded" in stray["upstream_message"]
    assert [line["request_id"] for line in proxy.lines()] == ["not-found", "stray"], "the ok line is below warning"
    assert [line["level"] for line in proxy.lines("started")] == ["warning"]
    (draining,) = proxy.lines("draining")
    assert draining["level"] == "warning"
    assert "Ctrl-C again to stop now" in draining["hint"] == DRAINING_HINT
    assert [line["level"] for line in proxy.lines("stopped")] == ["warning"]
    assert "Traceback" not in proxy.stderr_text()


async def test_a_scrape_of_the_backend_through_the_main_port_is_forwarded_but_not_booked(fake: FakeProcess) -> None:
    proxy = ServeProcess(fake.url, "--log-level", "debug")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT)) as http:
            for request_id in ("scrape-1", "scrape-2"):
                async with http.get(proxy.url + "/metrics", headers={"X-Request-Id": request_id}) as resp:
                    assert resp.status == 200
                    assert "fake_upstream:requests_running" in await resp.text(), "the backend's own metrics"
            await _post(http, proxy.url, "traffic")  # a model request after them, booked as ever
            await proxy.line(lambda line: line["request_id"] == "traffic")
            scrape = await proxy.line(lambda line: line["request_id"] == "scrape-2", event="scrape")
            async with http.get(proxy.admin_url + "/metrics") as resp:
                exposition = await resp.text()
    finally:
        proxy.stop()
    assert scrape["level"] == "debug"
    assert scrape["status"] == 200
    assert [line["request_id"] for line in proxy.lines()] == ["traffic"]
    counted = [row for row in exposition.splitlines() if row.startswith("streamwarden_requests_total{")]
    assert len(counted) == 1
    assert 'api="chat_completions"' in counted[0]
    assert not [row for row in exposition.splitlines() if 'api="other"' in row and not row.endswith(" 0.0")]
