"""`streamwarden check` against a hostile or broken backend: every body and stream it reads
is capped and every probe has a total deadline, so a 1.5 GB `/metrics`, a flood of events or one event
a second forever is a finding, never a hang or a heap that grows; what the backend sends is printed
with its control bytes escaped.

Small caps and deadlines keep the tests fast; nothing here measures a duration: each test asserts the
finding, and that the run ends within the test's own timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import orjson
import pytest
from aiohttp import web
from support import ServeUpstream
from support.hostile import Connection, RawUpstream, response

from proxy.tools.check.options import CheckOptions
from proxy.tools.check.report import FAIL, render_table
from proxy.tools.check.run import NoModel, run_check

pytestmark = pytest.mark.asyncio

CAP = 256 * 1024
MODELS = {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "me"}]}
ANSWER = {
    "id": "c1", "object": "chat.completion", "created": 1, "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}  # fmt: skip
CHUNK = b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,' \
        b'"delta":{"content":"x"},"finish_reason":null}]}\n\n'

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def endless_body(request: web.Request, content_type: str = "text/plain") -> web.StreamResponse:
    """A body that never ends (a 1.5 GB /metrics, as far as a reader can tell)."""
    response = web.StreamResponse(headers={"Content-Type": content_type})
    await response.prepare(request)
    block = b"x" * 65536
    while True:
        await response.write(block)


async def stream_forever(request: web.Request, pause: float) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    while True:
        await response.write(CHUNK)
        if pause:
            await asyncio.sleep(pause)  # the backend's pace, not a wait of the test's


def backend(*, models: Handler | None = None, metrics: Handler | None = None, stream: Handler | None = None) -> Handler:
    """Answers /v1/models and plain chat like a backend; the given handlers replace those parts."""

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/models":
            return await models(request) if models else web.json_response(MODELS)
        if request.path == "/metrics" and metrics:
            return await metrics(request)
        if request.path == "/v1/chat/completions" and request.method == "POST":
            body = orjson.loads(await request.read() or b"null") if request.can_read_body else None
            if isinstance(body, dict) and body.get("stream") and stream:
                return await stream(request)
            if isinstance(body, dict):
                return web.json_response(ANSWER)
            return web.json_response({"error": {"message": "bad json", "type": "invalid_request_error"}}, status=400)
        return web.Response(status=404)

    return handler


def options(url: str, **extra: object) -> CheckOptions:
    fields: dict[str, object] = {"timeout": 5.0, "max_body": CAP} | extra
    return CheckOptions(url, **fields)  # type: ignore[arg-type]


async def test_an_endless_metrics_body_is_a_finding(serve_upstream: ServeUpstream) -> None:
    url = await serve_upstream(backend(metrics=endless_body))
    report = await run_check(options(url))
    metrics = report.get("metrics")
    assert metrics is not None
    assert metrics.result == FAIL
    assert "GET /metrics answered more than 256 MiB" not in metrics.detail
    assert "GET /metrics answered more than 262,144 bytes (the check reads no more)" in metrics.detail


async def test_an_endless_models_body_needs_model_and_is_skipped_with_it(serve_upstream: ServeUpstream) -> None:
    url = await serve_upstream(backend(models=lambda r: endless_body(r, "application/json")))
    with pytest.raises(NoModel, match="GET /v1/models answered more than"):
        await run_check(options(url))
    report = await run_check(options(url, model="m"))
    chat = report.get("dialect.chat_completions")
    assert chat is not None
    assert chat.result == "ok"


async def test_a_stream_that_floods_events_is_cut_at_the_cap(serve_upstream: ServeUpstream) -> None:
    url = await serve_upstream(backend(stream=lambda r: stream_forever(r, 0)))
    report = await run_check(options(url, stream_deadline=600.0))
    terminal = report.get("stream.terminal")
    assert terminal is not None
    assert "the stream passed 262,144 bytes (the check reads no more)" in terminal.detail


async def test_a_stream_of_many_tiny_events_is_cut_at_the_event_cap(serve_upstream: ServeUpstream) -> None:
    async def tiny(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        while True:
            await response.write(b"data: {}\n\n" * 1000)

    url = await serve_upstream(backend(stream=tiny))
    report = await run_check(options(url, max_body=64 * 1024 * 1024, stream_deadline=600.0))
    terminal = report.get("stream.terminal")
    assert terminal is not None
    assert "the stream sent more than 20,000 events" in terminal.detail


async def test_a_stream_that_never_ends_is_ended_by_its_deadline(serve_upstream: ServeUpstream) -> None:
    url = await serve_upstream(backend(stream=lambda r: stream_forever(r, 0.05)))
    report = await run_check(options(url, stream_deadline=0.5))
    terminal = report.get("stream.terminal")
    assert terminal is not None
    assert "still streaming after 0.5 s (the check's bound on a stream)" in terminal.detail


async def test_a_probe_past_its_total_deadline_is_a_finding(serve_upstream: ServeUpstream) -> None:
    url = await serve_upstream(backend(stream=lambda r: stream_forever(r, 0.05)))
    report = await run_check(options(url, probe_deadline=0.3, stream_deadline=600.0))
    terminal = report.get("stream.terminal")
    assert terminal is not None
    assert terminal.result == FAIL
    assert terminal.detail == "did not finish within 0.3 s (the check's deadline per probe)"
    assert report.get("health") is not None  # the probes after it ran


async def test_control_bytes_from_the_backend_are_escaped_in_what_check_prints() -> None:
    """ESC/BEL/OSC in a model id and an error message, an 8-bit CSI (0x9b) in the Server header (a
    header parser refuses ESC itself), a bidi override: none reaches the terminal raw."""
    hostile = "m\x1b]52;c;SGVsbG8=\x07\x1b[2J\u202e"

    async def script(connection: Connection) -> None:
        while (request := await connection.next_request()) is not None:
            server = b"Server: evil\x9b31m\r\n"
            if request.target == b"/v1/models":
                await connection.send(response(200, orjson.dumps({"object": "list", "data": [{"id": hostile}]}),
                                               extra=server))
            else:
                message = {"error": {"message": f"no \x1b]0;title\x07 {hostile}", "type": "server_error"}}
                await connection.send(response(500, orjson.dumps(message), extra=server))

    upstream = RawUpstream(script)
    try:
        report = await run_check(options(await upstream.start()))
    finally:
        await upstream.close()
    table = render_table(report, width=200)
    assert not any(ord(c) < 0x20 and c != "\n" for c in table), repr(table)
    assert not any(0x7F <= ord(c) <= 0x9F for c in table), repr(table)
    assert "\u202e" not in table
    assert r"m\x1b]52;c;SGVsbG8=\x07\x1b[2J\u202e" in table  # the model id, escaped
    assert r"Server: evil\x9b31m" in table
    assert r"no \x1b]0;title\x07" in table  # the error message of a probe's detail
