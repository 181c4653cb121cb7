"""The `request` log line of design section 7: its fields and their values, one line per exchange, no secrets.

Each exchange's line is compared with what the client itself saw (status, bytes, events) and with what
the fake upstream recorded, so a field that drifts from the truth fails here, not in an operator's query.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from support import WAIT, FakeUpstream, Proxy, ProxyFactory, until
from support.ports import free_port

from proxy.config import Config
from proxy.observe.books import log_level
from proxy.observe.logs import Logger, make_logger
from proxy.server.app import build_state
from proxy.server.serve import Server

FIELDS = frozenset({
    "request_id", "method", "path", "api", "model", "stream", "status", "upstream_status", "outcome", "reason",
    "duration_ms", "ttft_ms", "events", "bytes_out", "prompt_tokens", "completion_tokens", "usage_source",
    "upstream_cancelled", "client",
    "abort_phase",  # where an aborted exchange was left (null otherwise)
})
STRUCTLOG = frozenset({"event", "level", "timestamp"})
PROMPT = "say hi please"  # 3 prompt tokens for the fake
CHAT = {"model": "m", "messages": [{"role": "user", "content": PROMPT}]}
SECRET_KEY = "sk-secret-4f1d"
PASSWORD = "s3cr3t-pw-9c2e"


def events_in(body: bytes) -> int:
    return len([block for block in body.split(b"\n\n") if block.strip()])


async def post(
    http: aiohttp.ClientSession, proxy: Proxy, rid: str, path: str, body: dict[str, Any], fault: str | None = None,
    **headers: str,
) -> tuple[int, bytes, dict[str, Any]]:
    sent = {"X-Request-Id": rid, **headers}
    if fault:
        sent["x-fault"] = fault
    async with http.post(f"{proxy.url}{path}", json=body, headers=sent) as resp:
        status, data = resp.status, await resp.read()
        assert resp.headers["X-Request-Id"] == rid
    return status, data, await proxy.line_for(rid)


UPSTREAM_SAID = {"upstream_4xx", "upstream_5xx", "upstream_error_frame", "stray_http_block"}


def check_shape(line: dict[str, Any]) -> None:
    # What the upstream said rides along on the failures it explains
    said = {"upstream_message"} if "upstream_message" in line else set()
    said |= {"cause"} if "cause" in line else set()  # why the way to the upstream failed
    assert set(line) == FIELDS | STRUCTLOG | said, set(line) ^ (FIELDS | STRUCTLOG | said)
    assert "upstream_message" not in said or line["reason"] in UPSTREAM_SAID, line["reason"]
    assert "cause" not in said or line["outcome"] == "error", line["reason"]
    assert line["event"] == "request"
    assert line["level"] == log_level(line["outcome"], line["reason"])  # warning on error
    assert isinstance(line["duration_ms"], float)
    assert line["duration_ms"] >= 0
    if line["ttft_ms"] is not None:
        assert 0 <= line["ttft_ms"] <= line["duration_ms"]
    assert line["client"] == "127.0.0.1"


async def abandon(
    http: aiohttp.ClientSession, proxy: Proxy, fake: FakeUpstream, rid: str, content_events: int, **headers: str
) -> int:
    """Read `content_events` content events of a slow stream, then close; returns the bytes read."""
    resp = await http.post(
        f"{proxy.url}/v1/chat/completions",
        json={**CHAT, "stream": True},
        headers={"X-Request-Id": rid, "x-fault": "slow;rate=4;tokens=1000", **headers},
    )
    received = b""
    try:
        assert resp.status == 200
        async with asyncio.timeout(WAIT):
            while received.count(b'"content":"') - received.count(b'"content":""') < content_events:
                received += await resp.content.readuntil(b"\n\n")
    finally:
        resp.close()
    assert (await fake.recorder.wait_finished(rid)).client_closed_at is not None
    return len(received)


# --- fields and values -----------------------------------------------------------------------------------


async def test_ok_stream_line(proxy: Proxy, fake_upstream: FakeUpstream, http: aiohttp.ClientSession) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    status, data, line = await post(http, proxy, "log-ok", "/v1/chat/completions", body)
    assert status == 200
    assert data.endswith(b"data: [DONE]\n\n")
    check_shape(line)
    assert line | {"duration_ms": 0, "ttft_ms": 0, "timestamp": ""} == {
        "request_id": "log-ok", "method": "POST", "path": "/v1/chat/completions", "api": "chat_completions",
        "model": "m", "stream": True, "status": 200, "upstream_status": 200, "outcome": "ok", "reason": "complete",
        "duration_ms": 0, "ttft_ms": 0,
        "events": 20,  # role chunk, 16 content chunks, finish chunk, usage chunk, [DONE]
        "bytes_out": len(data),
        "prompt_tokens": 3, "completion_tokens": 16, "usage_source": "usage", "upstream_cancelled": False,
        "client": "127.0.0.1", "event": "request", "level": "info", "timestamp": "", "abort_phase": None,
    }
    assert line["events"] == events_in(data)
    assert isinstance(line["ttft_ms"], float)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z", line["timestamp"])
    assert (await fake_upstream.recorder.wait_finished("log-ok")).completed


async def test_ok_whole_body_line_and_a_made_request_id(
    proxy: Proxy, fake_upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    async with http.post(f"{proxy.url}/v1/messages", json={**CHAT, "max_tokens": 1024}) as resp:
        data = await resp.read()
        rid = resp.headers["X-Request-Id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid)
    assert (await fake_upstream.recorder.wait_finished(rid)).completed  # the same id went upstream
    line = await proxy.line_for(rid)
    check_shape(line)
    assert {k: line[k] for k in ("api", "stream", "status", "upstream_status", "outcome", "reason", "ttft_ms",
                                  "events", "bytes_out", "prompt_tokens", "completion_tokens", "usage_source")} == {
        "api": "messages", "stream": False, "status": 200, "upstream_status": 200, "outcome": "ok",
        "reason": "complete", "ttft_ms": None, "events": 0, "bytes_out": len(data), "prompt_tokens": 3,
        "completion_tokens": 16, "usage_source": "usage",
    }


async def test_error_lines(
    make_proxy: ProxyFactory, proxy: Proxy, fake_upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    # An upstream 4xx, passed on as is.
    status, data, line = await post(http, proxy, "log-429", "/v1/completions",
                                    {"model": "m", "prompt": PROMPT}, fault="upstream_429")
    assert status == 429
    check_shape(line)
    assert {k: line[k] for k in ("api", "stream", "status", "upstream_status", "outcome", "reason", "ttft_ms",
                                  "events", "bytes_out", "prompt_tokens", "completion_tokens", "usage_source",
                                  "upstream_cancelled")} == {
        "api": "completions", "stream": False, "status": 429, "upstream_status": 429, "outcome": "error",
        "reason": "upstream_4xx", "ttft_ms": None, "events": 0, "bytes_out": len(data), "prompt_tokens": None,
        "completion_tokens": None, "usage_source": None, "upstream_cancelled": False,
    }

    # A stream cut after two content events: an error frame, the delivered events estimated.
    status, data, line = await post(http, proxy, "log-cut", "/v1/chat/completions", {**CHAT, "stream": True},
                                    fault="cut")
    assert status == 200
    assert b'"code":"stream_cut"' in data
    check_shape(line)
    assert {k: line[k] for k in ("stream", "status", "upstream_status", "outcome", "reason", "events", "bytes_out",
                                  "prompt_tokens", "completion_tokens", "usage_source", "upstream_cancelled")} == {
        "stream": True, "status": 200, "upstream_status": 200, "outcome": "error", "reason": "stream_cut",
        "events": 3,  # the upstream's role chunk and two content chunks; the proxy's error frame is not one
        "bytes_out": len(data), "prompt_tokens": None, "completion_tokens": 2, "usage_source": "estimated",
        "upstream_cancelled": True,
    }
    assert events_in(data) == 3 + 2  # plus the error frame and [DONE]
    assert isinstance(line["ttft_ms"], float)

    # No upstream at all.
    port = free_port()
    dead = await make_proxy(upstream=f"http://127.0.0.1:{port}")
    status, data, line = await post(http, dead, "log-dead", "/v1/chat/completions", {**CHAT, "stream": True})
    assert status == 502
    check_shape(line)
    assert {k: line[k] for k in ("stream", "status", "upstream_status", "outcome", "reason", "ttft_ms", "events",
                                  "usage_source", "upstream_cancelled")} == {
        "stream": True, "status": 502, "upstream_status": None, "outcome": "error", "reason": "connect_failed",
        "ttft_ms": None, "events": 0, "usage_source": None, "upstream_cancelled": False,
    }
    assert line["cause"].startswith("could not connect to the upstream: ")  # what the client was told


async def test_aborted_line(proxy: Proxy, fake_upstream: FakeUpstream, http: aiohttp.ClientSession) -> None:
    read = await abandon(http, proxy, fake_upstream, "log-abandoned", content_events=2)
    line = await proxy.line_for("log-abandoned")
    check_shape(line)
    assert {k: line[k] for k in ("stream", "status", "upstream_status", "outcome", "reason", "events", "bytes_out",
                                  "prompt_tokens", "completion_tokens", "usage_source", "upstream_cancelled")} == {
        "stream": True, "status": 200, "upstream_status": 200, "outcome": "aborted", "reason": "client_disconnect",
        "events": 3,  # role chunk and two content chunks (the next one is 250 ms away)
        "bytes_out": read, "prompt_tokens": None, "completion_tokens": 2, "usage_source": "estimated",
        "upstream_cancelled": True,
    }
    assert isinstance(line["ttft_ms"], float)
    assert line["abort_phase"] == "mid_stream"




@pytest.mark.parametrize(
    ("path", "body", "fault", "status"),
    [
        ("/v1/chat/completions", {**CHAT, "stream": True}, None, 200),
        ("/v1/chat/completions", {**CHAT, "stream": True}, "error_after_first", 200),
        ("/v1/chat/completions", CHAT, "null_200", 502),
        ("/v1/messages", {**CHAT, "max_tokens": 1024}, "upstream_detail", 400),
        ("/v1/chat/completions", {**CHAT, "stream": True}, "stray_503", 503),
        ("/v1/chat/completions", CHAT, "late_headers;delay=5", 504),
    ],
    ids=["stream", "error-frame", "replaced-body", "reshaped-4xx", "late-commit-status", "first-byte-timeout"],
)
async def test_bytes_out_is_what_the_client_received(
    make_proxy: ProxyFactory,
    fake_upstream: FakeUpstream,
    http: aiohttp.ClientSession,
    path: str,
    body: dict[str, Any],
    fault: str | None,
    status: int,
) -> None:
    proxy = await make_proxy(first_byte_timeout=0.3)
    got, data, line = await post(http, proxy, "bytes", path, body, fault)
    assert got == status
    assert data
    await fake_upstream.recorder.wait_finished("bytes")
    assert line["bytes_out"] == len(data)


async def test_one_line_per_exchange(
    proxy: Proxy, fake_upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    sent = []
    for i, fault in enumerate([None, "cut", "stall;hold=0.1", "upstream_5xx_flat", "malformed_event"]):
        rid = f"one-{i}"
        sent.append(rid)
        await post(http, proxy, rid, "/v1/chat/completions", {**CHAT, "stream": fault != "upstream_5xx_flat"},
                   fault)
    async with http.get(f"{proxy.url}/v1/models", headers={"X-Request-Id": "one-models"}) as resp:
        assert resp.status == 200
    sent.append("one-models")
    await abandon(http, proxy, fake_upstream, "one-abandoned", content_events=1)
    sent.append("one-abandoned")
    await proxy.line_for("one-models")
    await proxy.line_for("one-abandoned")
    for rid in sent:
        await fake_upstream.recorder.wait_finished(rid)
    assert sorted(line["request_id"] for line in proxy.log_lines()) == sorted(sent)
    # Nothing else is logged per exchange at info level or above.
    all_lines = [orjson.loads(text) for text in proxy.log.getvalue().splitlines()]
    assert [line["event"] for line in all_lines if line["level"] != "debug"] == ["request"] * len(sent)


# --- secrets -------------------------------------------------------------------------------------------------


def test_redacted_upstream_hides_the_password() -> None:
    config = Config(upstream=f"http://user:{PASSWORD}@127.0.0.1:8000/prefix")
    assert config.redacted_upstream() == "http://user:***@127.0.0.1:8000/prefix"
    assert Config(upstream="http://127.0.0.1:8000").redacted_upstream() == "http://127.0.0.1:8000"


def assert_no_secret(text: str) -> None:
    basic = base64.b64encode(f"user:{PASSWORD}".encode()).decode()
    for secret in (SECRET_KEY, PASSWORD, basic, "Bearer"):
        assert secret not in text, f"{secret!r} leaked into the log"


async def test_no_secret_in_the_exchange_lines(
    make_proxy: ProxyFactory, proxy: Proxy, fake_upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    auth = {"Authorization": f"Bearer {SECRET_KEY}", "Proxy-Authorization": f"Basic {SECRET_KEY}"}
    await post(http, proxy, "s-ok", "/v1/chat/completions", {**CHAT, "stream": True}, **auth)
    await post(http, proxy, "s-err", "/v1/chat/completions", CHAT, "upstream_429", **auth)
    await abandon(http, proxy, fake_upstream, "s-abandoned", 1, **auth)
    await proxy.line_for("s-abandoned")
    echo = fake_upstream.recorder.get("s-ok")
    assert echo is not None
    assert echo.headers["Authorization"] == f"Bearer {SECRET_KEY}"  # it was sent upstream
    assert_no_secret(proxy.log.getvalue())

    # An upstream URL with a password: the proxy authenticates upstream, and never logs it.
    with_password = await make_proxy(upstream=fake_upstream.url.replace("http://", f"http://user:{PASSWORD}@"))
    await post(http, with_password, "p-ok", "/v1/chat/completions", {**CHAT, "stream": True})
    await post(http, with_password, "p-err", "/v1/chat/completions", {**CHAT, "stream": True}, "cut")
    record = fake_upstream.recorder.get("p-ok")
    assert record is not None
    assert record.headers["Authorization"].startswith("Basic ")
    assert len(with_password.log_lines()) == 2
    assert_no_secret(with_password.log.getvalue())


async def test_upstream_password_and_a_client_authorization_header(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(upstream=fake_upstream.url.replace("http://", f"http://user:{PASSWORD}@"))
    headers = {"X-Request-Id": "p-auth", "Authorization": f"Bearer {SECRET_KEY}"}
    async with http.post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers=headers) as resp:
        status = resp.status
    line = await proxy.line_for("p-auth")
    assert_no_secret(proxy.log.getvalue())
    assert (status, line["status"], line["outcome"]) == (200, 200, "ok")


async def serve_until(config: Config, logger: Logger, ready: Callable[[], bool]) -> None:
    """A whole Server run writing to `logger`: started, then stopped as soon as `ready()` holds."""
    server = Server(config, build_state(config, logger=logger))
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(server.run())
    try:
        await until(ready)
        server.request_stop()
        await asyncio.wait_for(task, 10)
    finally:
        task.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def test_started_line_redacts_the_upstream_password() -> None:
    config = Config(upstream=f"http://user:{PASSWORD}@127.0.0.1:9", host="127.0.0.1", port=0, admin_port=0)
    stream = io.StringIO()
    await serve_until(config, make_logger("json", "info", stream), lambda: "upstream_down" in stream.getvalue())
    lines = [orjson.loads(text) for text in stream.getvalue().splitlines()]  # (upstream_down: the start's probe)
    assert [line["event"] for line in lines] == ["started", "upstream_down", "draining", "stopped"]
    assert lines[0]["upstream"] == lines[1]["upstream"] == "http://user:***@127.0.0.1:9"
    assert_no_secret(stream.getvalue())


@pytest.mark.parametrize("level", ["info", "debug"])
async def test_the_console_started_line_is_short_and_the_settings_are_at_debug(level: str) -> None:
    """Issue 35: the console's started line was one 963-character line of settings. It says what a reader
    needs at once (version, upstream, ports); every setting is one `settings` line at debug."""
    config = Config(upstream="http://127.0.0.1:9", host="127.0.0.1", port=0, admin_port=0, health_interval=0.0)
    stream = io.StringIO()
    await serve_until(config, make_logger("console", level, stream), lambda: " started " in stream.getvalue())
    lines = stream.getvalue().splitlines()
    [started] = [line for line in lines if " started " in line]
    assert len(started) <= 300, started
    assert "upstream=http://127.0.0.1:9" in started
    assert "idle_timeout" not in started
    settings = [line for line in lines if " settings " in line]
    if level == "debug":
        [line] = settings
        assert "'idle_timeout': 120.0" in line
    else:
        assert settings == []


README = Path(__file__).resolve().parents[2] / "README.md"


def readme_sample_line() -> dict[str, Any]:
    text = README.read_text()
    start = text.index("```json", text.index("<!-- sample log line:")) + len("```json")
    sample: dict[str, Any] = orjson.loads(text[start : text.index("```", start)])
    return sample


async def test_the_readmes_sample_line_has_a_real_lines_fields(proxy: Proxy, http: aiohttp.ClientSession) -> None:
    """The README shows one request line (issue 35: one had to run the proxy to see one): its fields are
    those of a real streamed chat's line, none missing, none made up."""
    sample = readme_sample_line()
    body = {"model": "demo", "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "hi"}]}
    headers = {"X-Request-Id": "readme-sample"}
    async with http.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200
        await resp.read()
    line = await proxy.line_for("readme-sample")
    assert sorted(sample) == sorted(line)
    assert {k: line[k] for k in ("api", "outcome", "reason", "usage_source", "level")} == {
        k: sample[k] for k in ("api", "outcome", "reason", "usage_source", "level")
    }


# --- console format -------------------------------------------------------------------------------------------


async def test_console_format_is_one_readable_line_per_request(
    fake_upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    config = dataclasses.replace(
        Config(upstream=fake_upstream.url), log_format="console", host="127.0.0.1", port=0, admin_port=0
    )
    stream = io.StringIO()
    state = build_state(config, logger=make_logger("console", "info", stream))
    server = Server(config, state)
    await server.start()
    base = f"http://127.0.0.1:{server.ports()[0]}"
    async with http.post(f"{base}/v1/chat/completions", json={**CHAT, "stream": True},
                         headers={"X-Request-Id": "console-1"}) as resp:
        assert resp.status == 200
        await resp.read()
    async with http.post(f"{base}/v1/chat/completions", json=CHAT,
                         headers={"X-Request-Id": "console-2", "x-fault": "upstream_429"}) as resp:
        assert resp.status == 429
    await until(lambda: stream.getvalue().count("\n") >= 2)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, lines
    for line, rid, outcome, reason, level in zip(
        lines, ("console-1", "console-2"), ("ok", "error"), ("complete", "upstream_4xx"), ("info", "warning"),
        strict=True,
    ):
        assert not line.startswith("{")
        assert "\x1b" not in line  # no colour codes in a log file
        assert re.match(rf"\d{{4}}-\d\d-\d\dT[\d:.]+Z \[{level}\s*\] request\s", line), line
        pairs = dict(word.split("=", 1) for word in line.split() if "=" in word)
        assert {k: pairs[k] for k in ("request_id", "outcome", "reason", "api", "model")} == {
            "request_id": rid, "outcome": outcome, "reason": reason, "api": "chat_completions", "model": "m",
        }
        assert float(pairs["duration_ms"]) >= 0
        assert set(pairs) >= FIELDS, FIELDS - set(pairs)
    server.request_stop()
    server.request_stop()
    await server.shutdown()
