"""The fault scenarios: one small function each, registered with the dialects and modes it applies to.

Pick one with the header ``x-fault: <name>[;key=value...]`` or the model ``fault/<name>[;key=value...]``.
``after`` counts every SSE event written, preamble included (chat: one role-only chunk per choice;
completions: none; responses: created, in_progress, output_item.added, content_part.added; messages:
message_start, content_block_start, ping). "first content" means the preamble plus one content event.

Each scenario's one-line summary lives in its registration below, the only copy: ``describe()``
reads the registry, and ``make docs`` renders it as the table in docs/fake-upstream.md.

"all" = chat_completions, completions, responses, messages, embeddings, models. Scenarios marked for
streams answer 400 to a non-stream request (and the reverse), as does an unknown name or parameter.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

import orjson
from aiohttp import web

from proxy.tools.fake.bodies import flat_error_body, html_page, whole_body
from proxy.tools.fake.exchange import Exchange
from proxy.tools.fake.faults import ATTEMPTS, Fault
from proxy.tools.fake.generation import (
    API_CHAT,
    API_COMPLETIONS,
    API_EMBEDDINGS,
    API_MESSAGES,
    API_MODELS,
    API_RESPONSES,
    MAX_TOKENS,
    BadRequest,
)
from proxy.tools.fake.streams import (
    CONTENT,
    DONE,
    FINISH,
    TERMINAL,
    Frame,
    first_content_end,
    malformed_frame,
    native_error_frame,
    sse,
    stray_block,
    stream_frames,
)

__all__ = ["SCENARIOS", "Scenario", "ScenarioInfo", "describe", "lookup", "stream_normally"]

Play = Callable[[Exchange, Fault], Awaitable[web.StreamResponse]]

GENERATION = frozenset({API_CHAT, API_COMPLETIONS, API_RESPONSES, API_MESSAGES})
CHAT_LIKE = frozenset({API_CHAT, API_COMPLETIONS})
ALL = GENERATION | {API_EMBEDDINGS, API_MODELS}
HOLD_SECONDS = 600.0
MAX_EVENT_SIZE = 256 * 1024 * 1024
ERROR_MESSAGE = "fake upstream: generation failed"
#: Parameters every scenario takes: ``per`` tokens (words) in each content event (1), and the mode of
#: ``/tokenize`` for this request (``words``; ``huge``, ``negative``, ``junk``, ``slow``: hostile).
COMMON_PARAMS = ("per", "tokenize")
STRAY_BODY = {"error": {"message": "Service Unavailable: engine overloaded", "type": "server_error", "code": 503}}


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    apis: frozenset[str]
    mode: str  # "stream", "whole" or "any"
    params: tuple[str, ...]
    summary: str
    play: Play


class ScenarioInfo(NamedTuple):
    name: str
    dialects: str
    summary: str


async def stream_normally(ex: Exchange) -> web.StreamResponse:
    """A healthy generation: the full stream, or the whole body."""
    if not ex.generation().stream:
        return await ex.whole()
    await ex.open_stream()
    await ex.send(ex.frames())
    return ex.finish()


def _preamble(frames: list[Frame]) -> int:
    return first_content_end(frames) - 1


def _breaks(ex: Exchange, fault: Fault) -> bool:
    """False for a retry or a continuation of a request whose fault says ``once=1``: served whole, so
    that ``--resume-on-cut`` (or a client's retry) can be seen to mend it."""
    return not fault.flag("once") or ex.request.app[ATTEMPTS].first(ex.request.headers)


async def _stray_503(ex: Exchange, fault: Fault) -> web.StreamResponse:
    if not _breaks(ex, fault):
        return await ex.normal()
    frames = ex.frames()
    after = fault.integer("after", _preamble(frames))  # right after the role chunk / response.created ...
    await ex.open_stream()
    await ex.send(frames[:after])
    await ex.send_raw(stray_block(503, "Service Unavailable", STRAY_BODY), counts=False)
    return ex.close()


async def _cut(ex: Exchange, fault: Fault) -> web.StreamResponse:
    if not _breaks(ex, fault):
        return await ex.normal()
    frames = ex.frames()
    after, eof = fault.integer("after", _preamble(frames) + 2), fault.flag("eof")
    await ex.open_stream()
    await ex.send(frames[:after])
    return ex.finish() if eof else ex.close()


async def _reset(ex: Exchange, fault: Fault) -> web.StreamResponse:
    if not _breaks(ex, fault):
        return await ex.normal()
    if ex.spec is None or not ex.spec.stream:
        return ex.reset()
    frames = ex.frames()
    after = fault.integer("after", _preamble(frames) + 2)
    await ex.open_stream()
    await ex.send(frames[:after])
    return ex.reset()


async def _first_content_then(ex: Exchange, frame: bytes, *, then_done: bool = False) -> web.StreamResponse:
    frames = ex.frames()
    await ex.open_stream()
    await ex.send(frames[: first_content_end(frames)])
    await ex.send_raw(frame)
    if then_done:
        await ex.send_raw(DONE)
    return ex.finish()


async def _error_after_first(ex: Exchange, fault: Fault) -> web.StreamResponse:
    frames = ex.frames()
    sent, hold = first_content_end(frames), fault.number("hold", HOLD_SECONDS)
    await ex.open_stream()
    await ex.send(frames[:sent])
    await ex.send_raw(native_error_frame(ex.generation(), ERROR_MESSAGE, sent))
    await ex.hold(hold)
    return ex.finish()


async def _error_object_foreign(ex: Exchange, fault: Fault) -> web.StreamResponse:
    return await _first_content_then(ex, sse(flat_error_body(ERROR_MESSAGE, 400, "BadRequestError")))


async def _error_string(ex: Exchange, fault: Fault) -> web.StreamResponse:
    return await _first_content_then(ex, sse({"error": ERROR_MESSAGE, "error_type": "generation"}))


async def _error_field(ex: Exchange, fault: Fault) -> web.StreamResponse:
    line = b'error: {"message":"' + ERROR_MESSAGE.encode() + b'","type":"server_error","code":500}\n\n'
    return await _first_content_then(ex, line, then_done=True)


async def _stall(ex: Exchange, fault: Fault) -> web.StreamResponse:
    if not _breaks(ex, fault):
        return await ex.normal()
    frames = ex.frames()
    after, hold = fault.integer("after", _preamble(frames) + 1), fault.number("hold", HOLD_SECONDS)
    await ex.open_stream()
    await ex.send(frames[:after])
    await ex.hold(hold)
    return ex.close()


async def _no_terminal(ex: Exchange, fault: Fault) -> web.StreamResponse:
    await ex.open_stream()
    await ex.send([f for f in ex.frames() if f.kind != TERMINAL])
    return ex.finish()


async def _malformed_event(ex: Exchange, fault: Fault) -> web.StreamResponse:
    frames = ex.frames()
    tokens = ex.generation().tokens
    at = min(fault.integer("at", tokens // 2), tokens)
    content_seen, cut = 0, len(frames)
    for index, frame in enumerate(frames):
        if content_seen >= at:
            cut = index
            break
        content_seen += frame.kind == CONTENT
    bad = Frame(malformed_frame(ex.api), "malformed")
    await ex.open_stream()
    await ex.send([*frames[:cut], bad, *frames[cut:]])
    return ex.finish()


async def _done_without_finish(ex: Exchange, fault: Fault) -> web.StreamResponse:
    await ex.open_stream()
    await ex.send([f for f in ex.frames() if f.kind != FINISH])
    return ex.finish()


async def _oversized_event(ex: Exchange, fault: Fault) -> web.StreamResponse:
    size = fault.integer("size", 9 * 1024 * 1024, maximum=MAX_EVENT_SIZE)
    spec = ex.generation()
    at = fault.integer("at", 1, maximum=MAX_TOKENS - 1)
    spec = spec.replace(tokens=max(spec.tokens, at + 1), pad=(at, 0))
    target = [f for f in stream_frames(spec) if f.kind == CONTENT][at * spec.choices].raw
    data_len = len(target) - (target.index(b"data: ") + len(b"data: ")) - 2
    ex.spec = spec.replace(pad=(at, size - data_len))
    return await stream_normally(ex)


async def _slow(ex: Exchange, fault: Fault) -> web.StreamResponse:
    ex.rate = fault.number("rate", 10.0)
    spec = ex.generation()
    if "tokens" in fault.params:
        ex.spec = spec.replace(tokens=fault.integer("tokens", spec.tokens, maximum=MAX_TOKENS), finish="stop")
    return await stream_normally(ex)


async def _null_200(ex: Exchange, fault: Fault) -> web.StreamResponse:
    return web.Response(body=b"null", content_type="application/json")


async def _empty_200(ex: Exchange, fault: Fault) -> web.StreamResponse:
    return web.Response(body=b"")


async def _error_in_200(ex: Exchange, fault: Fault) -> web.StreamResponse:
    return ex.json(flat_error_body("fake upstream: invalid request", 400, "BadRequestError"))


async def _batch_missing_choice(ex: Exchange, fault: Fault) -> web.StreamResponse:
    spec = ex.generation()
    missing = fault.integer("missing", spec.choices - 1)
    body = whole_body(spec)
    body["choices"] = [c for c in body["choices"] if c["index"] != missing]
    return ex.json(body)


async def _html_502(ex: Exchange, fault: Fault) -> web.StreamResponse:
    return web.Response(status=502, text=html_page(502, "Bad Gateway"), content_type="text/html")


async def _late_headers(ex: Exchange, fault: Fault) -> web.StreamResponse:
    await ex.hold(fault.number("delay", 5.0))
    return await ex.normal()


async def _slow_body(ex: Exchange, fault: Fault) -> web.StreamResponse:
    body = orjson.dumps(whole_body(ex.generation()))
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.content_length = len(body)
    ex.response = response
    try:
        await response.prepare(ex.request)
        await response.write(body[: len(body) // 2])
    except ConnectionResetError:
        return response
    await ex.hold(fault.number("delay", 5.0))
    await response.write(body[len(body) // 2 :])
    return response


async def _fail_first(ex: Exchange, fault: Fault) -> web.StreamResponse:
    failures = fault.integer("failures", ex.settings.first_attempt_failures)
    mode = fault.choice("mode", ("status", "stream"))
    if ex.request.app[ATTEMPTS].next(ex.request.headers, ex.body) > failures:
        return await ex.normal()
    if mode == "stream" and ex.spec is not None and ex.spec.stream:
        return await _stray_503(ex, Fault("stray_503"))
    message = "Service Unavailable: engine overloaded, retry"
    return ex.error(503, message, code="overloaded", headers={"Retry-After": "0"})


async def _upstream_4xx_native(ex: Exchange, fault: Fault) -> web.StreamResponse:
    status = fault.integer("status", 400, minimum=400)
    if status > 499:
        raise BadRequest("fault parameter 'status' must be a 4xx status")
    return ex.error(status, "fake upstream: request rejected", code="invalid_request")


async def _upstream_429(ex: Exchange, fault: Fault) -> web.StreamResponse:
    headers = {
        "Retry-After": "1",
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1s",
    }
    return ex.error(429, "Rate limit reached, retry after 1s", code="rate_limit_exceeded", headers=headers)


async def _upstream_5xx_flat(ex: Exchange, fault: Fault) -> web.StreamResponse:
    return ex.json(flat_error_body("fake upstream: internal error", 500, "InternalServerError"), 500)


async def _upstream_detail(ex: Exchange, fault: Fault) -> web.StreamResponse:
    return ex.json({"detail": "fake upstream: invalid request"}, 400)


async def _vllm_abort(ex: Exchange, fault: Fault) -> web.StreamResponse:
    """What vLLM sends when its engine aborts a request (shutdown, abort, pause): a 200 that looks done."""
    spec = ex.generation()
    ex.spec = spec.replace(tokens=fault.integer("at", spec.tokens // 2, maximum=spec.tokens), finish="abort")
    return await stream_normally(ex)


# The bytes real vLLM (0.32.0) sends when its EngineCore dies mid-stream: `json.dumps`' spaced JSON (its
# data chunks are compact), then [DONE], at the 200 already sent; then the server exits.
VLLM_ENGINE_DEAD_FRAME = (
    b'data: {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root '
    b'cause.", "type": "InternalServerError", "param": null, "code": 500}}\n\n'
)


async def _vllm_engine_dead(ex: Exchange, fault: Fault) -> web.StreamResponse:
    return await _first_content_then(ex, VLLM_ENGINE_DEAD_FRAME, then_done=True)


_REGISTRY = (
    Scenario("stray_503", GENERATION, "stream", ("after", "once"),
             "200, `after` events (the preamble), then a raw HTTP/1.0 503 block inside the body, then close "
             "(once=1: only a request's first attempt)", _stray_503),
    Scenario("cut", GENERATION, "stream", ("after", "eof", "once"),
             "`after` events (preamble + 2), then close with the body unterminated (eof=1: ended; once=1: "
             "only a request's first attempt, so a continuation or a retry with the same X-Request-Id or "
             "x-fault-key gets the whole answer)", _cut),
    Scenario("reset", ALL, "any", ("after", "once"),
             "`after` events (preamble + 2), then a TCP RST; non-stream: RST instead of an answer "
             "(once=1: only a request's first attempt)", _reset),
    Scenario("error_after_first", GENERATION, "stream", ("hold",),
             "first content, the dialect's own error frame, then silence for `hold` s (600)", _error_after_first),
    Scenario("error_object_foreign", CHAT_LIKE, "stream", (),
             'first content, then a flat {"object":"error",...} frame (SGLang), then end', _error_object_foreign),
    Scenario("error_string", CHAT_LIKE, "stream", (),
             'first content, then {"error":"text","error_type":...} (TGI), then end', _error_string),
    Scenario("error_field", CHAT_LIKE, "stream", (),
             "first content, a bare `error:` line (old llama.cpp), then [DONE]", _error_field),
    Scenario("stall", GENERATION, "stream", ("after", "hold", "once"),
             "`after` events (preamble + 1), then silence for `hold` s (600), then close (once=1: only a "
             "request's first attempt)", _stall),
    Scenario("no_terminal", GENERATION, "stream", (),
             "the whole generation but no [DONE] / message_stop / response.completed", _no_terminal),
    Scenario("malformed_event", GENERATION, "stream", ("at",),
             "one event of cut-off JSON after `at` content events (half); otherwise normal", _malformed_event),
    Scenario("done_without_finish", CHAT_LIKE, "stream", (),
             "content, then [DONE], with no finish_reason on any chunk", _done_without_finish),
    Scenario("oversized_event", GENERATION, "stream", ("size", "at"),
             "content event `at` (1) padded to a data payload of `size` bytes (9 MiB)", _oversized_event),
    Scenario("slow", GENERATION, "any", ("rate", "tokens"),
             "a normal answer at `rate` events/s (10), `tokens` long", _slow),
    Scenario("null_200", ALL, "any", (), "200 application/json with the body null (vLLM #42794)", _null_200),
    Scenario("empty_200", ALL, "any", (), "200 with an empty body", _empty_200),
    Scenario("error_in_200", ALL, "any", (), 'a 200 whose JSON is {"object":"error",...,"code":400}', _error_in_200),
    Scenario("batch_missing_choice", frozenset({API_COMPLETIONS}), "whole", ("missing",),
             "a batch answer without choice index `missing` (the last)", _batch_missing_choice),
    Scenario("html_502", ALL, "any", (), "502 text/html page from nginx", _html_502),
    Scenario("late_headers", ALL, "any", ("delay",),
             "waits `delay` s (5) before the response headers, then answers normally", _late_headers),
    Scenario("slow_body", GENERATION, "whole", ("delay",),
             "200 and the first half of the whole JSON body, the rest after `delay` s (5)", _slow_body),
    Scenario("fail_first", ALL, "any", ("failures", "mode"),
             "the first `failures` attempts per x-fault-key (else body hash) get 503 + Retry-After: 0; "
             "mode=stream: 200 + stray 503 block; later attempts succeed", _fail_first),
    Scenario("upstream_4xx_native", ALL, "any", ("status",),
             "`status` (400) with the dialect's own error JSON", _upstream_4xx_native),
    Scenario("upstream_429", ALL, "any", (),
             "429 with Retry-After: 1, x-ratelimit-* headers and the dialect's error JSON", _upstream_429),
    Scenario("upstream_5xx_flat", ALL, "any", (), 'a 500 with a flat {"object":"error",...} body', _upstream_5xx_flat),
    Scenario("upstream_detail", ALL, "any", (), 'a 400 with FastAPI\'s {"detail": "..."}', _upstream_detail),
    Scenario("vllm_abort", CHAT_LIKE, "any", ("at",),
             '`at` content events (half), then every choice ends with finish_reason "abort" and [DONE] '
             "(vLLM #57082); non-stream: a 200 whose choices say abort", _vllm_abort),
    Scenario("vllm_engine_dead", CHAT_LIKE, "stream", (),
             "first content, then real vLLM's engine-death frame (spaced JSON, InternalServerError 500), "
             "then [DONE]", _vllm_engine_dead),
)  # fmt: skip

SCENARIOS = MappingProxyType({s.name: s for s in _REGISTRY})


def lookup(fault: Fault, api: str, stream: bool) -> Scenario:
    """The scenario ``fault`` names, checked against this request; ``BadRequest`` says what is wrong."""
    scenario = SCENARIOS.get(fault.name)
    if scenario is None:
        raise BadRequest(f"unknown fault {fault.name!r}; known faults: {', '.join(SCENARIOS)}")
    if api not in scenario.apis:
        raise BadRequest(
            f"fault {fault.name!r} does not apply to {api}; it applies to {', '.join(sorted(scenario.apis))}"
        )
    if scenario.mode == "stream" and not stream:
        raise BadRequest(f'fault {fault.name!r} needs a streaming request ("stream": true)')
    if scenario.mode == "whole" and stream:
        raise BadRequest(f"fault {fault.name!r} needs a non-streaming request")
    unknown = sorted(set(fault.params) - set(scenario.params) - set(COMMON_PARAMS))
    if unknown:
        allowed = ", ".join(scenario.params) or "none"
        raise BadRequest(f"fault {fault.name!r} has no parameter {', '.join(unknown)} (parameters: {allowed})")
    return scenario


def describe() -> list[ScenarioInfo]:
    """One row per scenario: name, the dialects it applies to, and what it does (parameters in backticks,
    defaults in parentheses), for the README and ``--help`` texts."""
    rows = []
    for s in _REGISTRY:
        dialects = "all" if s.apis == ALL else ", ".join(sorted(s.apis))
        if s.mode != "any":
            dialects += " (stream)" if s.mode == "stream" else " (non-stream)"
        rows.append(ScenarioInfo(s.name, dialects, s.summary))
    return rows
