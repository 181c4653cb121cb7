"""OpenTelemetry traces, exported by the SDK's own OTLP/HTTP exporter to a real receiver.

The receiver is an aiohttp server on loopback that accepts `POST /v1/traces` and decodes the protobuf
body with `opentelemetry-proto`, as a collector would. The upstream is a hand-made server that records
the trace headers it received, so the test sees the whole chain: client -> proxy span -> upstream.
"""

from __future__ import annotations

import asyncio
import gzip
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from support import AiohttpServer, FakeUpstream, Proxy, ProxyFactory, ServeUpstream, until
from support.hostile import ServeProcess
from support.hostile import until as hostile_until
from support.metrics import call, leave_when
from support.ports import free_port

from proxy.observe.tracing import Tracing

# The longest a span attribute may be: a logged string (256 characters), each escaped as at most `\uXXXX`.
MAX_ATTRIBUTE_LENGTH = 256 * 6
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


class Receiver:
    """An OTLP/HTTP traces endpoint: every exported span, decoded."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.resources: list[dict[str, Any]] = []
        self.content_types: set[str] = set()

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        self.content_types.add(request.headers.get("Content-Type", ""))
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        for resource_spans in export.resource_spans:
            self.resources.append(attributes(resource_spans.resource.attributes))
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(scope_spans.spans)
        return web.Response(body=b"", content_type="application/x-protobuf")

    def span(self, name: str) -> Span:
        found = [s for s in self.spans if s.name == name]
        assert len(found) == 1, [s.name for s in self.spans]
        return found[0]


def value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind)


def attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: value(kv.value) for kv in kvs}


@pytest.fixture
async def receiver(aiohttp_server: AiohttpServer) -> tuple[Receiver, str]:
    receiver = Receiver()
    app = web.Application()
    app.router.add_post("/v1/traces", receiver.handle)
    server = await aiohttp_server(app)
    return receiver, str(server.make_url("")).rstrip("/")


SSE = (
    b'data: {"id":"c1","model":"served-model","choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
    b'data: {"id":"c1","model":"served-model","choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
    b'data: {"id":"c1","model":"served-model","choices":[{"index":0,"delta":{"content":"lo"}}]}\n\n'
    b'data: {"id":"c1","model":"served-model","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    b'data: {"id":"c1","model":"served-model","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}\n\n'
    b"data: [DONE]\n\n"
)


@pytest.fixture
async def traced(
    make_proxy: ProxyFactory, serve_upstream: ServeUpstream, receiver: tuple[Receiver, str]
) -> AsyncIterator[tuple[Proxy, Receiver, list[dict[str, str]]]]:
    seen: list[dict[str, str]] = []
    never = asyncio.Event()

    async def upstream(request: web.Request) -> web.StreamResponse:
        seen.append({k.lower(): v for k, v in request.headers.items()})
        body = await request.json()
        if body.get("model") == "hang":
            await never.wait()
        if body.get("model") == "broken":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(SSE[: SSE.index(b"data", 10)] + b'HTTP/1.1 503 Service Unavailable\r\n\r\n{"error":"x"}')
            return resp
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(SSE)
        return resp

    rec, url = receiver
    proxy = await make_proxy(upstream=await serve_upstream(upstream), otlp_endpoint=url)
    tracing = proxy.state.books.tracing
    assert tracing is not None
    try:
        yield proxy, rec, seen
    finally:
        await asyncio.to_thread(tracing.close)


async def flushed(proxy: Proxy) -> None:
    tracing = proxy.state.books.tracing
    assert tracing is not None
    # The exporter posts (from the SDK's thread) to a receiver on this loop: never block the loop on it.
    assert await asyncio.to_thread(tracing.flush)


CHAT = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


async def test_a_stream_becomes_one_server_span_continuing_the_client_trace(
    traced: tuple[Proxy, Receiver, list[dict[str, str]]], http: aiohttp.ClientSession
) -> None:
    proxy, receiver, seen = traced
    headers = {"traceparent": TRACEPARENT, "tracestate": "vendor=abc", "X-Request-Id": "tr-ok"}
    async with http.post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers=headers) as resp:
        assert resp.status == 200
        await resp.read()
    await proxy.line_for("tr-ok")
    await flushed(proxy)

    span = receiver.span("chat m")
    assert receiver.content_types == {"application/x-protobuf"}
    assert span.kind == Span.SPAN_KIND_SERVER
    assert span.trace_id.hex() == CLIENT_TRACE
    assert span.parent_span_id.hex() == CLIENT_SPAN
    assert attributes(span.attributes) | {"url.path": "/v1/chat/completions"} == {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "m",
        "gen_ai.response.model": "served-model",
        "gen_ai.request.stream": True,
        "gen_ai.usage.input_tokens": 7,
        "gen_ai.usage.output_tokens": 2,
        "gen_ai.response.finish_reasons": ["stop"],
        "streamwarden.outcome": "ok",
        "streamwarden.reason": "complete",
        "streamwarden.api": "chat_completions",
        "http.request.method": "POST",
        "http.response.status_code": 200,
        "url.path": "/v1/chat/completions",
    }
    assert [e.name for e in span.events] == ["first_token"]
    assert span.start_time_unix_nano <= span.events[0].time_unix_nano <= span.end_time_unix_nano
    assert span.status.code == span.status.STATUS_CODE_UNSET
    assert span.trace_state == "vendor=abc"
    assert receiver.resources[0]["service.name"] == "streamwarden"

    # Upstream: the proxy's span is the parent now, in the same trace; the client's tracestate goes on.
    [upstream] = seen
    version, trace_id, parent_id, flags = upstream["traceparent"].split("-")
    assert (version, trace_id, parent_id, flags) == ("00", CLIENT_TRACE, span.span_id.hex(), "01")
    assert upstream["tracestate"] == "vendor=abc"


async def test_without_a_client_trace_the_proxy_starts_one(
    traced: tuple[Proxy, Receiver, list[dict[str, str]]], http: aiohttp.ClientSession
) -> None:
    proxy, receiver, seen = traced
    async with http.post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "tr-new"}) as resp:
        await resp.read()
    await proxy.line_for("tr-new")
    await flushed(proxy)
    span = receiver.span("chat m")
    assert span.parent_span_id == b""
    version, trace_id, parent_id, flags = seen[0]["traceparent"].split("-")
    assert (version, trace_id, parent_id) == ("00", span.trace_id.hex(), span.span_id.hex())
    assert int(flags, 16) & 1  # sampled (the SDK also sets W3C level 2's random-trace-id bit)
    assert "tracestate" not in seen[0]


async def test_a_trace_the_client_did_not_sample_stays_unsampled(
    traced: tuple[Proxy, Receiver, list[dict[str, str]]], http: aiohttp.ClientSession
) -> None:
    proxy, receiver, seen = traced
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00", "X-Request-Id": "tr-unsampled"}
    async with http.post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers=headers) as resp:
        await resp.read()
    await proxy.line_for("tr-unsampled")
    await flushed(proxy)
    assert receiver.spans == []  # the SDK's default sampler follows the parent's decision
    version, trace_id, _, flags = seen[0]["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", CLIENT_TRACE, "00")  # the trace goes on, unsampled


@pytest.mark.parametrize("traceparent", ["garbage", "00-" + "0" * 32 + "-" + "0" * 16 + "-01", "ff-x-y-z"])
async def test_an_invalid_client_traceparent_starts_a_new_trace(
    traced: tuple[Proxy, Receiver, list[dict[str, str]]], http: aiohttp.ClientSession, traceparent: str
) -> None:
    proxy, receiver, seen = traced
    headers = {"traceparent": traceparent, "tracestate": "vendor=abc", "X-Request-Id": "tr-bad"}
    async with http.post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers=headers) as resp:
        assert resp.status == 200
        await resp.read()
    await proxy.line_for("tr-bad")
    await flushed(proxy)
    span = receiver.span("chat m")
    assert span.parent_span_id == b""
    assert seen[0]["traceparent"].split("-")[1:3] == [span.trace_id.hex(), span.span_id.hex()]
    assert "tracestate" not in seen[0]  # it belonged to the trace that could not be read


async def test_errors_and_aborts_carry_error_type_and_rewrite_events(
    traced: tuple[Proxy, Receiver, list[dict[str, str]]], http: aiohttp.ClientSession
) -> None:
    proxy, receiver, _ = traced
    async with http.post(f"{proxy.url}/v1/chat/completions", json={**CHAT, "model": "broken"},
                         headers={"X-Request-Id": "tr-err"}) as resp:
        assert resp.status == 503  # a stray block before any content: a real status (late commit)
        await resp.read()
    await proxy.line_for("tr-err")
    await leave_when(http, proxy, "tr-abort", "/v1/chat/completions", {**CHAT, "model": "hang"},
                     lambda ex: ex.phase == "awaiting_headers")
    await flushed(proxy)

    error = receiver.span("chat broken")
    attrs = attributes(error.attributes)
    assert (attrs["streamwarden.outcome"], attrs["error.type"]) == ("error", "stray_http_block")
    assert (error.status.code, error.status.message) == (error.status.STATUS_CODE_ERROR, "stray_http_block")
    rewrites = [attributes(e.attributes) for e in error.events if e.name == "rewrite"]
    assert rewrites == [{"streamwarden.rewrite.reason": "stray_http_block"},
                        {"streamwarden.rewrite.reason": "late_commit_status"}]

    aborted = receiver.span("chat hang")
    attrs = attributes(aborted.attributes)
    assert (attrs["streamwarden.outcome"], attrs["error.type"]) == ("aborted", "client_disconnect")
    assert attrs["streamwarden.abort_phase"] == "before_headers"
    assert aborted.status.code == aborted.status.STATUS_CODE_UNSET  # the client's doing, not a failure


async def test_non_genai_paths_are_plain_http_spans(
    traced: tuple[Proxy, Receiver, list[dict[str, str]]], http: aiohttp.ClientSession
) -> None:
    proxy, receiver, _ = traced
    async with http.post(f"{proxy.url}/tokenize", json={"model": "x", "prompt": "hi"},
                         headers={"X-Request-Id": "tr-other"}) as resp:
        await resp.read()
    await proxy.line_for("tr-other")
    await flushed(proxy)
    span = receiver.span("POST")
    attrs = attributes(span.attributes)
    assert "gen_ai.operation.name" not in attrs
    assert attrs["streamwarden.api"] == "other"


def test_no_endpoint_no_sdk() -> None:
    """Zero cost without an endpoint: the proxy runs without importing the OpenTelemetry SDK at all."""
    code = (
        "import sys\n"
        "from proxy.server.app import build_state\n"
        "from proxy.config import Config\n"
        "state = build_state(Config(upstream='http://127.0.0.1:9'))\n"
        "assert state.books.tracing is None\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr


async def test_a_collector_that_is_down_costs_the_client_nothing(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """The exporter's failures stay in the SDK's thread: requests are served and logged as usual."""
    down = f"http://127.0.0.1:{free_port()}"
    proxy = await make_proxy(otlp_endpoint=down)
    default = proxy.state.books.tracing
    assert default is not None
    await asyncio.to_thread(default.close)
    proxy.state.books.tracing = tracing = Tracing(down, timeout=0.5)  # give up exporting quickly
    try:
        status, _ = await call(http, proxy, fake_upstream, "tr-down", "chat_completions", stream=True)
        assert status == 200
        assert (await proxy.line_for("tr-down"))["outcome"] == "ok"
        # The export fails (the SDK logs it) within its own bound; nothing else does.
        await asyncio.wait_for(asyncio.to_thread(tracing.flush, 5_000), 10)
    finally:
        await asyncio.to_thread(tracing.close)
    assert not proxy.log_lines("tracing_error")


async def test_a_refused_connection_is_a_plain_error_span(
    traced: tuple[Proxy, Receiver, list[dict[str, str]]],
) -> None:
    proxy, receiver, seen = traced
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n")  # > 64 KiB
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n"), 10)
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 431")
    await until(lambda: any(line["reason"] == "bad_request" for line in proxy.log_lines()))
    await flushed(proxy)
    span = receiver.span("HTTP")
    attrs = attributes(span.attributes)
    assert (attrs["streamwarden.outcome"], attrs["error.type"], attrs["http.response.status_code"]) == (
        "error", "bad_request", 431,
    )
    assert seen == []  # nothing went upstream


# What the client and the upstream send is bounded in spans as in the log line.
async def test_client_strings_in_spans_are_cut_and_escaped_as_in_the_log(
    traced: tuple[Proxy, Receiver, list[dict[str, str]]], http: aiohttp.ClientSession
) -> None:
    proxy, receiver, _ = traced
    model = "\x1b[31m" + "m" * 200_000
    async with http.post(f"{proxy.url}/v1/chat/completions", json={**CHAT, "model": model},
                         headers={"X-Request-Id": "tr-big"}) as resp:
        await resp.read()
    async with http.post(f"{proxy.url}/x/{'p' * 7_000}", json={}, headers={"X-Request-Id": "tr-path"}) as resp:
        await resp.read()
    logged = await proxy.line_for("tr-big")
    logged_path = await proxy.line_for("tr-path")
    await flushed(proxy)
    chat = receiver.span(f"chat {logged['model']}")  # the span's name carries the log line's model
    assert attributes(chat.attributes)["gen_ai.request.model"] == logged["model"]
    assert logged["model"] == "\\x1b[31m" + "m" * 251  # 256 characters, then escaped
    assert attributes(receiver.span("POST").attributes)["url.path"] == logged_path["path"]
    for span in receiver.spans:
        for key, value in attributes(span.attributes).items():
            if isinstance(value, str):
                assert len(value) <= MAX_ATTRIBUTE_LENGTH, key
                assert "\x1b" not in value, key


async def test_the_sdk_attribute_limit_is_set_when_the_operator_set_none(
    traced: tuple[Proxy, Receiver, list[dict[str, str]]],
) -> None:
    """Whatever a future attribute forgets to cut, the SDK cuts (OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT's default)."""
    proxy, receiver, _ = traced
    tracing = proxy.state.books.tracing
    assert tracing is not None
    span = tracing.tracer.start_span("probe", attributes={"x": "y" * 100_000})
    span.end()
    await flushed(proxy)
    assert len(attributes(receiver.span("probe").attributes)["x"]) == MAX_ATTRIBUTE_LENGTH


# The SDK's own messages are structured log lines of the proxy.
async def test_sdk_log_records_go_through_the_proxy_s_logger(
    traced: tuple[Proxy, Receiver, list[dict[str, str]]], http: aiohttp.ClientSession
) -> None:
    proxy, _, _ = traced
    headers = {"traceparent": "00-" + "a" * 600, "X-Request-Id": "tr-long-parent"}
    async with http.post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers=headers) as resp:
        await resp.read()
    await proxy.line_for("tr-long-parent")
    [line] = [line for line in proxy.log_lines("otel_sdk") if "traceparent" in line["message"]]
    assert line["level"] == "warning"
    assert line["source"].startswith("opentelemetry.")


async def test_a_hanging_collector_does_not_hold_shutdown_past_the_drain_bound(
    aiohttp_server: AiohttpServer, tmp_path: Any
) -> None:
    """`serve` with a collector that accepts and never answers exits within --drain-timeout + 1 s (+ slack).

    Before: the SDK's exporter (10 s timeout, then retries) flushed at interpreter exit, 8.7-30 s.
    """
    hang = asyncio.Event()

    async def collector(request: web.Request) -> web.Response:
        await hang.wait()
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/traces", collector)
    collector_url = str((await aiohttp_server(app)).make_url("")).rstrip("/")

    async def fake(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}]})

    upstream = web.Application()
    upstream.router.add_route("*", "/{tail:.*}", fake)
    upstream_url = str((await aiohttp_server(upstream)).make_url("")).rstrip("/")
    proc = ServeProcess(upstream_url, "--otlp-endpoint", collector_url, "--drain-timeout", "0.5")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            async with http.post(proc.url + "/v1/chat/completions", json={"model": "m", "messages": []}) as resp:
                assert resp.status == 200
        proc.signal(signal.SIGTERM)
        started = time.monotonic()
        assert await asyncio.to_thread(proc.proc.wait, 30) == 0
        took = time.monotonic() - started
    finally:
        hang.set()
        proc.stop()
    lines = proc.stderr_text().splitlines()
    assert took < 8.0, took  # the bound (0.5 + 1 s) plus slack for a busy machine; the SDK alone takes 10 s
    for line in lines:
        orjson.loads(line)  # every line the process wrote is a structured one


async def test_workers_flush_within_their_drain_and_are_not_killed(aiohttp_server: AiohttpServer) -> None:
    """`--workers 2` and a collector that never answers: before, each worker was killed at drain + 3 s."""
    hang = asyncio.Event()

    async def collector(request: web.Request) -> web.Response:
        await hang.wait()
        return web.Response()

    async def fake(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}]})

    collector_app, upstream = web.Application(), web.Application()
    collector_app.router.add_post("/v1/traces", collector)
    upstream.router.add_route("*", "/{tail:.*}", fake)
    collector_url = str((await aiohttp_server(collector_app)).make_url("")).rstrip("/")
    upstream_url = str((await aiohttp_server(upstream)).make_url("")).rstrip("/")
    proc = ServeProcess(upstream_url, "--workers", "2", "--otlp-endpoint", collector_url, "--drain-timeout", "0.5")
    try:
        await hostile_until(lambda: len(proc.lines("worker_ready")) == 2)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            for _ in range(6):  # fresh connections: both workers serve some
                async with http.post(proc.url + "/v1/chat/completions", json={"model": "m", "messages": []}) as resp:
                    assert resp.status == 200
        proc.signal(signal.SIGTERM)
        assert await asyncio.wait_for(asyncio.to_thread(proc.proc.wait), 30) == 0
    finally:
        hang.set()
        proc.stop()
    assert proc.lines("worker_killed") == []


def test_the_sdk_log_bridge_clears_its_weak_references() -> None:
    """logging keeps a weak reference to every handler. Compiled as a native class, the bridge (a subclass
    of the interpreted `logging.Handler`) left them pointing at freed memory: the process crashed
    (segmentation fault) in the collector or at exit. In a process of its own, which a crash kills."""
    script = (
        "import gc, weakref; from proxy.observe.tracing import SdkLogBridge\n"
        "bridge = SdkLogBridge(None); ref = weakref.ref(bridge)\n"
        "del bridge; gc.collect(); print(ref() is None)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd="/")
    assert (done.returncode, done.stdout, done.stderr) == (0, "True\n", "")
