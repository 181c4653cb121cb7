"""`streamwarden check` against the fake upstream: a well-behaved fake passes every probe, and each
quirk the fake can show (`--quirk NAME`) is reported by the probe that is about it, with its flags."""

from __future__ import annotations

import pytest
from aiohttp import web
from support import AiohttpServer, ServeUpstream

from proxy.tools.check.abandon import probe_stops_generation
from proxy.tools.check.backends import BACKENDS
from proxy.tools.check.client import Upstream
from proxy.tools.check.options import CheckOptions
from proxy.tools.check.probes import Context
from proxy.tools.check.report import PROBE_IDS, Report
from proxy.tools.check.run import NoModel, run_check
from proxy.tools.fake import FakeSettings, build_app
from proxy.tools.fake.quirks import QUIRKS

RATE = 1000.0  # content events per second: an abandoned stream of the abort probes (4096) runs 4 s, past the close


async def check(aiohttp_server: AiohttpServer, quirk: str | None = None) -> Report:
    server = await aiohttp_server(build_app(FakeSettings(token_rate=RATE, quirk=quirk)))
    return await run_check(CheckOptions(str(server.make_url("")).rstrip("/"), timeout=20.0))


async def test_a_well_behaved_backend_passes_every_probe(aiohttp_server: AiohttpServer) -> None:
    report = await check(aiohttp_server)
    assert [f.id for f in report.probes] == list(PROBE_IDS)
    assert {f.id: f.result for f in report.probes} == dict.fromkeys(PROBE_IDS, "ok")
    assert report.model == "fake-model"
    assert report.server is not None
    assert report.server.startswith("streamwarden fake-upstream")
    assert report.recommended_flags == ["--health-path /health"]
    stops = report.get("abort.stops_generation")
    assert stops is not None
    assert "stopped" in stops.detail
    data = report.to_json()
    assert set(data) == {"upstream", "server", "model", "probes", "recommended_flags"}
    assert Report.from_json(data).to_json() == data


# quirk -> (the probe that reports it, its result, words of its detail, flags it calls for)
EXPECTED: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "no_done": ("stream.terminal", "quirk", "no [DONE]", ()),
    "stray_block": ("stream.terminal", "quirk", "stray HTTP block (HTTP 503", ()),
    "cut": ("stream.terminal", "quirk", "cut after", ()),
    "abort_finish": ("stream.terminal", "quirk", 'finish_reason "abort"', ()),
    "no_usage": ("stream.usage", "quirk", "include_usage was ignored", ()),
    "malformed_500": ("errors.malformed_json", "quirk", "500", ()),
    "overflow_500": ("errors.context_overflow", "quirk", "answered 500", ()),
    "runs_on": ("abort.stops_generation", "quirk", "went on", ()),
    "conversation_replay": ("abort.conversation_replay", "quirk", "went on", ("--cancel-hook llama-conversation",)),
    "prefill_echo": ("resume.prefill", "quirk", "echoed in the first delta", ()),
    "no_prefill": ("resume.prefill", "unsupported", "starts over", ()),
    "no_metrics": ("metrics", "unsupported", "GET /metrics: 404", ()),
    "health_lies": ("health", "quirk", "yet no request succeeds", ()),
    "chat_only": ("dialect.messages", "unsupported", "404", ()),
}


def test_every_quirk_of_the_fake_is_expected_somewhere() -> None:
    assert set(EXPECTED) == set(QUIRKS)


@pytest.mark.parametrize("quirk", list(EXPECTED))
async def test_each_quirk_is_reported(aiohttp_server: AiohttpServer, quirk: str) -> None:
    probe, result, words, flags = EXPECTED[quirk]
    report = await check(aiohttp_server, quirk)
    assert [f.id for f in report.probes] == list(PROBE_IDS)  # every probe still reports, whatever broke
    finding = report.get(probe)
    assert finding is not None
    assert (finding.result, words in finding.detail) == (result, True), finding
    assert set(flags) <= set(finding.flags)
    for flag in flags:
        assert flag in report.recommended_flags
    for other in report.probes:
        assert "\n" not in other.detail
        assert len(other.detail) <= 400


async def test_no_metrics_leaves_abandonment_unknown(aiohttp_server: AiohttpServer) -> None:
    report = await check(aiohttp_server, "no_metrics")
    results = {f.id: f.result for f in report.probes}
    assert results["abort.stops_generation"] == results["abort.conversation_replay"] == "unknown"


async def test_only_chat_served_names_each_missing_dialect(aiohttp_server: AiohttpServer) -> None:
    report = await check(aiohttp_server, "chat_only")
    results = {f.id: f.result for f in report.probes}
    assert results["dialect.chat_completions"] == "ok"
    assert [results[f"dialect.{d}"] for d in ("completions", "responses", "messages")] == ["unsupported"] * 3
    terminal = report.get("stream.terminal")
    assert terminal is not None
    assert terminal.result == "ok"
    assert "messages" not in terminal.detail


async def test_a_backend_that_names_no_model_needs_model(serve_upstream: ServeUpstream) -> None:
    async def locked(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "invalid api key"}}, status=401)

    url = await serve_upstream(locked)
    with pytest.raises(NoModel, match=r"answered 401 and names no model: give --model NAME \(and --api-key KEY\)"):
        await run_check(CheckOptions(url, timeout=5.0))


async def test_a_generating_health_check_is_preferred(aiohttp_server: AiohttpServer) -> None:
    """SGLang's /health_generate runs a generation: the health probe recommends it over /health."""
    app = build_app(FakeSettings(token_rate=RATE))

    async def health_generate(request: web.Request) -> web.Response:
        return web.Response()

    app.router.add_get("/health_generate", health_generate)
    server = await aiohttp_server(app)
    report = await run_check(CheckOptions(str(server.make_url("")).rstrip("/"), timeout=20.0))
    health = report.get("health")
    assert health is not None
    assert (health.result, health.flags) == ("ok", ("--health-path /health_generate",))
    assert "/health 200, /health_generate 200, /v1/models 200" in health.detail


async def test_a_generation_over_before_the_close_is_unknown(serve_upstream: ServeUpstream) -> None:
    """A backend that generated the whole answer before the check had read its first events (vLLM's tiny
    model beside a CPU hog, issue 35): nothing was running at the close, so the full count is no run-on,
    and neither abandonment probe calls it a quirk or recommends a hook."""
    books = {"generated": 0, "asked": 0}

    async def backend(request: web.Request) -> web.StreamResponse:
        if request.path == "/metrics":
            text = f"fake_upstream:generation_tokens_total {books['generated']}\nfake_upstream:requests_running 0\n"
            return web.Response(text=text)
        body = await request.json()
        books["asked"] = body["max_tokens"]
        books["generated"] += body["max_tokens"]  # all of it, before the first event is read
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(16):
            await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"w%d "}}]}\n\n' % i)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    url = await serve_upstream(backend)
    async with Upstream(url, api_key=None, timeout=10.0) as upstream:
        ctx = Context(upstream, "m", backend=BACKENDS[-1], context_length=131072)
        plain = await probe_stops_generation(ctx)
        assert (plain.result, plain.flags) == ("unknown", ()), plain
        assert "over before the client's close" in plain.detail
        assert books["asked"] == 4096  # a generation far longer than a close takes
