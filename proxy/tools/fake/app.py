"""The fake upstream server: routes, the per-request wrapper that keeps the record, and ``run``.

It must be served with ``handler_cancellation=True``: ``run`` passes it, and aiohttp's own test server
(``aiohttp_server(build_app(...))``) always enables it in aiohttp 3.14 (passing it a second time there
raises ``TypeError``; with an ``AppRunner`` pass it yourself). Without it aiohttp lets a handler run on
after its client left, so a proxy's cancellation would only show up at the next write, and a silent
(stalled) handler would never notice at all.

Endpoints (the ``/v1`` prefix is optional): ``POST chat/completions``, ``completions``, ``responses``,
``messages``, ``embeddings``; ``GET models``, ``health``; ``POST /tokenize`` (vLLM's and
llama-server's fields, one token per word; ``x-fault: ...;tokenize=MODE`` makes it hostile: ``huge``
(a 16 MiB body), ``negative`` (count -5), ``junk`` (HTML), ``slow`` (never answers)). Test
helpers: ``/_fake/echo[/...]`` (any method; answers JSON ``method``, ``path`` and ``query`` (raw,
still percent-encoded), ``headers`` (as received), ``raw_headers`` (ordered pairs), ``body`` (base64), ``request_id``),
``GET /_fake/download?bytes=N[&chunk=K]`` (N deterministic bytes, byte ``i`` is ``i % 256``),
``GET /_fake/requests`` and ``GET /_fake/requests/{request_id}`` (records).
"""

from __future__ import annotations

import asyncio
import base64
import math
import socket
import uuid
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web
from yarl import URL

from proxy.tools.fake.bodies import embeddings_body, error_body, models_body
from proxy.tools.fake.exchange import SETTINGS, ClientGone, Exchange, FakeSettings, NormalPlay
from proxy.tools.fake.faults import ATTEMPTS, Attempts, Fault, select_fault
from proxy.tools.fake.generation import (
    API_CHAT,
    API_COMPLETIONS,
    API_EMBEDDINGS,
    API_MESSAGES,
    API_MODELS,
    API_OTHER,
    API_RESPONSES,
    GENERATION_APIS,
    MAX_TOKENS,
    BadRequest,
    count_text_tokens,
    parse_spec,
)
from proxy.tools.fake.quirks import (
    STATS,
    FakeStats,
    cancel_run_ons,
    continuation,
    metrics_text,
    quirk_fault,
    run_on,
    runs_on,
    unserved,
)
from proxy.tools.fake.recorder import RECORDER, Recorder, RequestRecord
from proxy.tools.fake.scenarios import HOLD_SECONDS, lookup, stream_normally

__all__ = ["RATE_HEADER", "build_app", "run"]

RATE_HEADER = "x-fake-rate"
MAX_REQUEST_BODY = 256 * 1024 * 1024
MAX_DOWNLOAD = 16 * 1024**3
_REQUEST_ID: web.RequestKey[str] = web.RequestKey("fake_request_id", str)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(settings: FakeSettings = FakeSettings()) -> web.Application:  # noqa: B008 (frozen value)
    """A fresh fake upstream with its own recorder and attempt counters."""
    app = web.Application(client_max_size=MAX_REQUEST_BODY)
    app[SETTINGS] = settings
    app[RECORDER] = Recorder()
    app[ATTEMPTS] = Attempts()
    app[STATS] = FakeStats()
    app.on_response_prepare.append(_add_request_id)
    app.on_cleanup.append(cancel_run_ons)
    if settings.quirk != "no_metrics":
        app.router.add_get("/metrics", _metrics)
    if settings.tokenize:
        app.router.add_post("/tokenize", _tokenize)
    for prefix in ("", "/v1"):
        for api, path in (
            (API_CHAT, "/chat/completions"),
            (API_COMPLETIONS, "/completions"),
            (API_RESPONSES, "/responses"),
            (API_MESSAGES, "/messages"),
        ):
            app.router.add_post(prefix + path, _endpoint(api, stream_normally))
        app.router.add_post(prefix + "/embeddings", _endpoint(API_EMBEDDINGS, _embeddings))
        app.router.add_get(prefix + "/models", _endpoint(API_MODELS, _models))
        app.router.add_get(prefix + "/health", _endpoint(API_OTHER, _health))
    app.router.add_route("*", r"/_fake/echo{tail:(/.*)?}", _endpoint(API_OTHER, _echo))
    app.router.add_get("/_fake/download", _endpoint(API_OTHER, _download))
    app.router.add_get("/_fake/requests", _list_requests)
    app.router.add_get("/_fake/requests/{request_id}", _one_request)
    return app


def run(host: str = "127.0.0.1", port: int = 8000, settings: FakeSettings = FakeSettings()) -> None:  # noqa: B008
    """Serve until interrupted, printing one line with the URL (the real port, also for ``port=0``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family)
    url = URL.build(scheme="http", host=host, port=sock.getsockname()[1])

    def announce(*_: object) -> None:
        print(f"streamwarden fake upstream listening on {url}", flush=True)

    web.run_app(build_app(settings), sock=sock, print=announce, handler_cancellation=True)


def _endpoint(api: str, normal: NormalPlay) -> Handler:
    """Wrap one route: record the request, pick its scenario, play it, and close the record once."""

    async def handler(request: web.Request) -> web.StreamResponse:
        recorder = request.app[RECORDER]
        request_id = request.headers.get("X-Request-Id") or f"fake-{uuid.uuid4().hex}"
        request[_REQUEST_ID] = request_id
        record = RequestRecord(request_id, request.method, request.path, api=api, headers=_headers(request))
        exchange: Exchange | None = None
        completed = False
        stats = request.app[STATS]
        stats.running += api in GENERATION_APIS
        try:
            body = await request.read()
            exchange, play = _prepare(request, record, api, body, normal)
            recorder.begin(record)
            response = await play(exchange)
            completed = True
            return response
        except BadRequest as exc:
            completed = True
            if exchange is not None and exchange.response is not None and exchange.response.prepared:
                return exchange.close()  # never a second response inside a started body
            return _bad_request(api, exc)
        except ClientGone:
            if exchange is not None and exchange.response is not None:
                return exchange.response
            return web.Response()
        except asyncio.CancelledError:
            recorder.client_closed(record)
            spec = exchange.spec if exchange is not None else None
            if exchange and spec and spec.stream and runs_on(request.app[SETTINGS].quirk, request.headers):
                run_on(stats, spec.completion_tokens - exchange.content_sent, exchange.rate)
            raise
        finally:
            stats.running -= api in GENERATION_APIS
            if recorder.get(request_id) is not record:  # failed before it was stored
                recorder.begin(record)
            recorder.finish(record, completed=completed)

    return handler


def _prepare(
    request: web.Request, record: RequestRecord, api: str, body: bytes, normal: NormalPlay
) -> tuple[Exchange, Callable[[Exchange], Awaitable[web.StreamResponse]]]:
    """Parse the request and choose what to play; ``BadRequest`` for anything the fake cannot serve."""
    settings = request.app[SETTINGS]
    quirk = settings.quirk
    refused = unserved(quirk, api, GENERATION_APIS)
    if refused is not None:
        raise BadRequest(refused[1], status=refused[0])
    parsed: object = None
    if api in GENERATION_APIS or api == API_EMBEDDINGS:
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            status = 500 if quirk == "malformed_500" else 400
            raise BadRequest("the request body is not valid JSON", status=status) from None
    fault = select_fault(request.headers, parsed)
    spec = None
    if api in GENERATION_APIS:
        spec = parse_spec(api, parsed, record.request_id, settings.tokens)
        record.stream = spec.stream
        if spec.prompt_tokens > MAX_TOKENS:
            status = 500 if quirk == "overflow_500" else 400
            message = f"the request ({spec.prompt_tokens} prompt tokens) exceeds the context size ({MAX_TOKENS})"
            raise BadRequest(message, "messages", status=status)
        spec = continuation(spec, parsed, quirk)
        if quirk == "no_usage":
            spec = spec.replace(include_usage=False)
        if fault is None:
            fault = _quirk_fault(quirk, api, spec.stream)
        else:
            spec = spec.replace(per=fault.integer("per", 1, minimum=1, maximum=64))
    record.scenario = fault.name if fault is not None else None
    exchange = Exchange(request, record, api=api, body=body, spec=spec, rate=_rate(request, settings), normal=normal)
    if fault is None:
        return exchange, normal
    scenario = lookup(fault, api, record.stream)

    async def play(ex: Exchange) -> web.StreamResponse:
        return await scenario.play(ex, fault)

    return exchange, play


def _quirk_fault(quirk: str | None, api: str, stream: bool) -> Fault | None:
    """The scenario a quirk replays on this request, where that scenario applies."""
    name = quirk_fault(quirk, stream)
    if name is None:
        return None
    try:
        lookup(Fault(name), api, stream)
    except BadRequest:
        return None  # not for this dialect: served as usual
    return Fault(name)


def _rate(request: web.Request, settings: FakeSettings) -> float:
    raw = request.headers.get(RATE_HEADER)
    if raw is None:
        return settings.token_rate
    try:
        rate = float(raw)
    except ValueError:
        rate = -1.0
    if not math.isfinite(rate) or rate < 0:
        raise BadRequest(f"header {RATE_HEADER} must be a number of events per second >= 0, got {raw!r}")
    return rate


def _bad_request(api: str, exc: BadRequest) -> web.Response:
    body = error_body(api, exc.status, exc.message, code="invalid_request" if exc.status == 400 else None)
    if api != API_MESSAGES:
        body["error"]["param"] = exc.param
    return web.Response(status=exc.status, body=orjson.dumps(body), content_type="application/json")


def _headers(request: web.Request) -> dict[str, str]:
    """Request headers as received (original case; repeated ones joined with ", ")."""
    out: dict[str, str] = {}
    for raw_name, raw_value in request.raw_headers:
        name, value = raw_name.decode("latin-1"), raw_value.decode("latin-1")
        out[name] = f"{out[name]}, {value}" if name in out else value
    return out


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    request_id = request.get(_REQUEST_ID)
    if request_id is not None:
        response.headers["X-Request-Id"] = request_id


async def _embeddings(ex: Exchange) -> web.StreamResponse:
    return ex.json(embeddings_body(orjson.loads(ex.body)))


async def _models(ex: Exchange) -> web.StreamResponse:
    return ex.json(models_body())


async def _health(ex: Exchange) -> web.StreamResponse:
    return web.Response()


async def _metrics(request: web.Request) -> web.Response:
    """The fake's own Prometheus page (not a recorded request: scrapes would crowd the records)."""
    return web.Response(text=metrics_text(request.app[STATS]), content_type="text/plain", charset="utf-8")


_TOKENIZE_MODES = ("words", "huge", "negative", "junk", "slow")
_HUGE_TOKENIZE = 16 * 1024 * 1024


async def _tokenize(request: web.Request) -> web.StreamResponse:
    """vLLM's `/tokenize` (``prompt``; llama-server's ``content``), or a hostile one (``tokenize=MODE``).

    Not a recorded request: it carries the stream's X-Request-Id, whose record it would replace."""
    body = await request.read()
    fault = select_fault(request.headers, None)
    try:
        mode = fault.choice("tokenize", _TOKENIZE_MODES) if fault is not None else "words"
        parsed = orjson.loads(body)
    except (BadRequest, orjson.JSONDecodeError) as exc:
        return web.json_response({"error": {"message": str(exc), "type": "BadRequestError"}}, status=400)
    request.app[STATS].tokenized += 1
    request.app[STATS].tokenize_asked.set()
    text = parsed.get("prompt", parsed.get("content")) if isinstance(parsed, dict) else None
    if not isinstance(text, str):
        return web.json_response({"error": {"message": "'prompt' must be a string"}}, status=400)
    if mode == "slow":
        await asyncio.sleep(HOLD_SECONDS)
    if mode == "junk":
        return web.Response(text="<html>tokenizer on fire</html>", content_type="text/html")
    if mode == "negative":
        return web.json_response({"count": -5, "max_model_len": MAX_TOKENS, "tokens": []})
    if mode == "huge":
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        piece = b"0," * 32 * 1024
        try:
            await response.write(b'{"tokens": [')
            for _ in range(_HUGE_TOKENIZE // len(piece)):
                await response.write(piece)
            await response.write(b"0]}")
        except ConnectionResetError:
            pass  # (the reader stopped at its limit)
        return response
    count = count_text_tokens(text)
    return web.json_response({"count": count, "max_model_len": MAX_TOKENS, "tokens": list(range(count))})


async def _echo(ex: Exchange) -> web.StreamResponse:
    """The request exactly as it arrived, so forwarding tests can compare it with what they sent."""
    request = ex.request
    path, _, query = request.raw_path.partition("?")
    return ex.json(
        {
            "method": request.method,
            "path": path,
            "query": query,
            "headers": ex.record.headers,
            "raw_headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in request.raw_headers],
            "body": base64.b64encode(ex.body).decode(),
            "request_id": ex.record.request_id,
        }
    )


async def _download(ex: Exchange) -> web.StreamResponse:
    """``bytes`` deterministic bytes in ``chunk``-sized writes, each awaited (so memory stays flat)."""
    size = _query_int(ex.request, "bytes", 0, MAX_DOWNLOAD)
    chunk = _query_int(ex.request, "chunk", 64 * 1024, 16 * 1024 * 1024) or 64 * 1024
    pattern = bytes(range(256)) * (chunk // 256 + 2)
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    response.content_length = size
    ex.response = response
    await response.prepare(ex.request)
    sent = 0
    try:
        while sent < size:
            start = sent % 256
            piece = pattern[start : start + min(chunk, size - sent)]
            await response.write(piece)
            sent += len(piece)
    except ConnectionResetError:
        ex.request.app[RECORDER].client_closed(ex.record)
        raise ClientGone from None
    return response


def _query_int(request: web.Request, key: str, default: int, maximum: int) -> int:
    raw = request.query.get(key)
    if raw is None:
        return default
    if not raw.isdigit() or int(raw) > maximum:
        raise BadRequest(f"query parameter {key!r} must be an integer from 0 to {maximum}", key)
    return int(raw)


async def _list_requests(request: web.Request) -> web.Response:
    records = [r.to_json() for r in request.app[RECORDER].all()]
    return web.Response(body=orjson.dumps(records), content_type="application/json")


async def _one_request(request: web.Request) -> web.Response:
    request_id = request.match_info["request_id"]
    record = request.app[RECORDER].get(request_id)
    if record is None:
        body = error_body(API_OTHER, 404, f"no request with id {request_id!r}", code="not_found")
        return web.Response(status=404, body=orjson.dumps(body), content_type="application/json")
    return web.Response(body=orjson.dumps(record.to_json()), content_type="application/json")
