"""Whole-body verdicts end to end (design section 6): what a client gets for a broken non-stream answer.

A 2xx that is not a result (``null``, empty, an error object, a batch with missing choices) becomes the
dialect's JSON error with the status of design section 10; an error in another backend's shape or an
HTML page keeps its status and headers and gets its message rewritten into the dialect's shape; an error
already in the dialect's shape passes byte for byte. Each case is checked with a raw client (status,
headers, exact JSON, log line) and with the official SDKs (the exception class they raise).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest
from multidict import CIMultiDictProxy
from support import WAIT, FakeUpstream, Proxy, ProxyFactory
from support.guard_cases import ALL, ANTHROPIC_MESSAGES, ANTHROPIC_TYPE, MESSAGES, OPENAI_TYPE, REQUESTS, error_body
from support.ports import free_port

# The headers an SDK acts on, which must survive any rewrite.
RETRY_HEADERS = ("Retry-After", "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                 "x-ratelimit-reset-requests")  # fmt: skip


@dataclass(frozen=True)
class Rewritten:
    """The upstream's answer replaced by the dialect's error JSON."""

    status: int
    message: str
    code: str | int  # the upstream's own code when it gave one
    reason: str
    upstream_status: int


REWRITTEN = {
    "null_200": Rewritten(502, "the upstream answered with a null body", "invalid_upstream_body",
                          "invalid_upstream_body", 200),
    "empty_200": Rewritten(502, "the upstream answered with an empty body", "invalid_upstream_body",
                           "invalid_upstream_body", 200),
    "error_in_200": Rewritten(400, "fake upstream: invalid request", 400, "upstream_error_frame", 200),
    "html_502": Rewritten(502, "502 Bad Gateway", "upstream_5xx", "upstream_5xx", 502),
    "upstream_5xx_flat": Rewritten(500, "fake upstream: internal error", 500, "upstream_5xx", 500),
    "upstream_detail": Rewritten(400, "fake upstream: invalid request", "upstream_4xx", "upstream_4xx", 400),
}  # fmt: skip

# Errors already in the dialect's own shape: passed byte for byte, headers included.
UNTOUCHED = {
    "upstream_429": (429, "upstream_4xx"),
    "upstream_4xx_native": (400, "upstream_4xx"),
    "upstream_4xx_native;status=404": (404, "upstream_4xx"),
    "fail_first": (503, "upstream_5xx"),
}


@dataclass
class Answer:
    status: int
    headers: CIMultiDictProxy[str]
    body: bytes


async def post(
    http: aiohttp.ClientSession, base: str, dialect: str, rid: str, fault: str | None,
    *, stream: bool = False, body: dict[str, Any] | None = None, key: str | None = None,
) -> Answer:  # fmt: skip
    """``key`` is the fake's attempt key for ``fail_first`` (else it counts attempts per body)."""
    path, default = REQUESTS[dialect]
    headers = {"X-Request-Id": rid, **({"x-fault": fault} if fault else {}), **({"x-fault-key": key} if key else {})}
    async with asyncio.timeout(WAIT):  # below the 30 s of the slowest fault here
        async with http.post(base + path, json={**(body or default), "stream": stream}, headers=headers) as resp:
            return Answer(resp.status, resp.headers, await resp.read())


def verdict(line: dict[str, Any]) -> tuple[str, str, int, int | None]:
    return line["outcome"], line["reason"], line["status"], line["upstream_status"]


# ---- raw client ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream-request"])
@pytest.mark.parametrize("dialect", ALL)
@pytest.mark.parametrize("fault", list(REWRITTEN))
async def test_broken_body_becomes_the_dialect_error(
    proxy: Proxy, fake_upstream: FakeUpstream, http: aiohttp.ClientSession, fault: str, dialect: str, stream: bool
) -> None:
    case = REWRITTEN[fault]
    rid = f"{fault}-{dialect}-{stream}"
    direct = await post(http, fake_upstream.url, dialect, rid + "-direct", fault, stream=stream)
    got = await post(http, proxy.url, dialect, rid, fault, stream=stream)
    assert direct.status == case.upstream_status  # the fault does what it says
    assert got.status == case.status
    assert got.headers["Content-Type"].split(";")[0] == "application/json"
    assert got.headers["X-Request-Id"] == rid
    assert int(got.headers["Content-Length"]) == len(got.body)
    assert orjson.loads(got.body) == error_body(dialect, case.status, case.message, case.code)
    line = await proxy.line_for(rid)
    assert verdict(line) == ("error", case.reason, case.status, case.upstream_status)


@pytest.mark.parametrize("dialect", ALL)
@pytest.mark.parametrize("fault", list(UNTOUCHED))
async def test_native_error_passes_untouched(
    proxy: Proxy, fake_upstream: FakeUpstream, http: aiohttp.ClientSession, fault: str, dialect: str
) -> None:
    status, reason = UNTOUCHED[fault]
    rid = f"native-{dialect}"
    got = await post(http, proxy.url, dialect, rid, fault, key="through-proxy")
    direct = await post(http, fake_upstream.url, dialect, rid, fault, key="direct")
    assert direct.status == got.status == status
    assert got.body == direct.body
    assert got.headers["Content-Type"] == direct.headers["Content-Type"]
    assert {h: got.headers.get(h) for h in RETRY_HEADERS} == {h: direct.headers.get(h) for h in RETRY_HEADERS}
    if fault == "upstream_429":
        assert got.headers["Retry-After"] == "1"
        assert got.headers["x-ratelimit-remaining-requests"] == "0"
    line = await proxy.line_for(rid)
    assert verdict(line) == ("error", reason, status, status)


@pytest.mark.parametrize(("missing", "named"), [(None, "3"), ("1", "1")])
async def test_batch_missing_choice_names_the_index(
    proxy: Proxy, http: aiohttp.ClientSession, missing: str | None, named: str
) -> None:
    fault = "batch_missing_choice" + (f";missing={missing}" if missing else "")
    body = {"model": "m", "prompt": ["a", "b"], "n": 2, "max_tokens": 4}
    got = await post(http, proxy.url, "completions", "batch", fault, body=body)
    message = f"the upstream returned 3 of 4 choices; missing indices: {named}"
    assert got.status == 502
    assert orjson.loads(got.body) == error_body("completions", 502, message, "incomplete_batch")
    line = await proxy.line_for("batch")
    assert verdict(line) == ("error", "incomplete_batch", 502, 200)


@pytest.mark.parametrize("dialect", ALL)
async def test_no_headers_in_time_is_a_504(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, http: aiohttp.ClientSession, dialect: str
) -> None:
    proxy = await make_proxy(first_byte_timeout=0.3)
    rid = f"late-headers-{dialect}"
    got = await post(http, proxy.url, dialect, rid, "late_headers;delay=30", stream=True)
    message = "the upstream sent no response headers within 0.3 s"
    assert got.status == 504
    assert orjson.loads(got.body) == error_body(dialect, 504, message, "first_byte_timeout")
    record = await fake_upstream.recorder.wait_finished(rid)
    assert record.client_closed_at is not None  # the proxy gave up on the upstream request
    line = await proxy.line_for(rid)
    assert verdict(line) == ("error", "first_byte_timeout", 504, None)


@pytest.mark.parametrize("dialect", ALL)
async def test_reset_before_answer_is_a_502(proxy: Proxy, http: aiohttp.ClientSession, dialect: str) -> None:
    rid = f"reset-{dialect}"
    got = await post(http, proxy.url, dialect, rid, "reset")
    message = "the upstream closed the connection before answering"
    assert got.status == 502
    assert orjson.loads(got.body) == error_body(dialect, 502, message, "connect_failed")
    line = await proxy.line_for(rid)
    assert verdict(line) == ("error", "connect_failed", 502, None)


@pytest.mark.parametrize("dialect", ALL)
async def test_no_upstream_is_a_502(make_proxy: ProxyFactory, http: aiohttp.ClientSession, dialect: str) -> None:
    port = free_port()  # (a port that was free a moment ago and has no listener now)
    proxy = await make_proxy(upstream=f"http://127.0.0.1:{port}")
    rid = f"refused-{dialect}"
    got = await post(http, proxy.url, dialect, rid, None, stream=True)
    assert got.status == 502
    error = orjson.loads(got.body)
    message = error["error"]["message"]
    assert message.startswith("could not connect to the upstream")
    assert error == error_body(dialect, 502, message, "connect_failed")
    line = await proxy.line_for(rid)
    assert verdict(line) == ("error", "connect_failed", 502, None)


# ---- the SDKs -----------------------------------------------------------------------------------------

# fault -> (openai class, anthropic class, status)
SDK_CLASSES: dict[str, tuple[type[openai.APIStatusError], type[anthropic.APIStatusError], int]] = {
    "null_200": (openai.InternalServerError, anthropic.InternalServerError, 502),
    "empty_200": (openai.InternalServerError, anthropic.InternalServerError, 502),
    "error_in_200": (openai.BadRequestError, anthropic.BadRequestError, 400),
    "html_502": (openai.InternalServerError, anthropic.InternalServerError, 502),
    "upstream_5xx_flat": (openai.InternalServerError, anthropic.InternalServerError, 500),
    "upstream_detail": (openai.BadRequestError, anthropic.BadRequestError, 400),
    "upstream_429": (openai.RateLimitError, anthropic.RateLimitError, 429),
    "upstream_4xx_native;status=404": (openai.NotFoundError, anthropic.NotFoundError, 404),
    "reset": (openai.InternalServerError, anthropic.InternalServerError, 502),
}


def _openai(proxy: Proxy) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=10)


async def _openai_call(client: openai.AsyncOpenAI, dialect: str, fault: str) -> object:
    headers = {"x-fault": fault}
    if dialect == "chat_completions":
        return await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4,
                                                    extra_headers=headers)  # fmt: skip
    if dialect == "completions":
        return await client.completions.create(model="m", prompt="hi", max_tokens=4, extra_headers=headers)
    return await client.responses.create(model="m", input="hi", max_output_tokens=4, extra_headers=headers)


@pytest.mark.parametrize("dialect", ["chat_completions", "completions", "responses"])
@pytest.mark.parametrize("fault", list(SDK_CLASSES))
async def test_openai_raises_the_status_class(proxy: Proxy, fault: str, dialect: str) -> None:
    expected, _, status = SDK_CLASSES[fault]
    async with _openai(proxy) as client:
        with pytest.raises(openai.APIStatusError) as info:
            await _openai_call(client, dialect, fault)
    assert type(info.value) is expected
    assert info.value.status_code == status
    assert info.value.type == OPENAI_TYPE[status]
    if fault in REWRITTEN:
        assert info.value.code == str(REWRITTEN[fault].code)  # (the SDK makes a numeric code text)
        assert REWRITTEN[fault].message in info.value.message


@pytest.mark.parametrize("fault", list(SDK_CLASSES))
async def test_anthropic_raises_the_status_class(proxy: Proxy, fault: str) -> None:
    _, expected, status = SDK_CLASSES[fault]
    async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key="unused", max_retries=0, timeout=10) as client:
        with pytest.raises(anthropic.APIStatusError) as info:
            await client.messages.create(model="m", max_tokens=4, messages=ANTHROPIC_MESSAGES,
                                         extra_headers={"x-fault": fault})  # fmt: skip
    assert type(info.value) is expected
    assert info.value.status_code == status
    assert info.value.type == ANTHROPIC_TYPE[status]
    if fault in REWRITTEN:
        assert REWRITTEN[fault].message in info.value.message


async def test_openai_batch_missing_choice(proxy: Proxy) -> None:
    async with _openai(proxy) as client:
        with pytest.raises(openai.InternalServerError) as info:
            await client.completions.create(model="m", prompt=["a", "b"], n=2, max_tokens=4,
                                            extra_headers={"x-fault": "batch_missing_choice"})  # fmt: skip
    assert info.value.status_code == 502
    assert info.value.code == "incomplete_batch"
    assert "missing indices: 3" in info.value.message


async def test_sdks_on_a_first_byte_timeout(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(first_byte_timeout=0.3)
    async with _openai(proxy) as client:
        with pytest.raises(openai.InternalServerError) as oai:
            await _openai_call(client, "chat_completions", "late_headers;delay=30")
    async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key="unused", max_retries=0, timeout=10) as client:
        with pytest.raises(anthropic.GatewayTimeoutError) as ant:
            await client.messages.create(model="m", max_tokens=4, messages=ANTHROPIC_MESSAGES,
                                         extra_headers={"x-fault": "late_headers;delay=30"})  # fmt: skip
    assert (oai.value.status_code, oai.value.type, oai.value.code) == (504, "timeout_error", "first_byte_timeout")
    assert (ant.value.status_code, ant.value.type) == (504, "timeout_error")


# ---- a 2xx body too large to judge whole: relayed as it comes, its usage read from its end -------------


@pytest.mark.parametrize("framing", ["length", "chunked"])
async def test_a_large_2xx_body_is_relayed_unjudged_and_its_usage_booked(
    serve_upstream: Any, make_proxy: ProxyFactory, http: aiohttp.ClientSession, framing: str
) -> None:
    """An embeddings answer past the judged prefix (4 MiB) goes through byte for byte, in pieces, and
    its `usage` (at the end of the body) still reaches the books."""
    from aiohttp import web

    vector = ",".join(["0.0123456789"] * 1024).encode()
    items = b",".join(b'{"object":"embedding","index":%d,"embedding":[%s]}' % (i, vector) for i in range(600))
    body = b'{"object":"list","data":[' + items + b'],"model":"m","usage":{"prompt_tokens":4321,"total_tokens":4321}}'
    assert len(body) > 5 * 1024 * 1024

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        if framing == "length":
            response.content_length = len(body)
        await response.prepare(request)
        for start in range(0, len(body), 256 * 1024):
            await response.write(body[start : start + 256 * 1024])
        await response.write_eof()
        return response

    proxy = await make_proxy(upstream=await serve_upstream(handler))
    async with http.post(proxy.url + "/v1/embeddings", json={"model": "m", "input": ["a"]},
                         headers={"X-Request-Id": f"large-{framing}"}) as resp:  # fmt: skip
        assert resp.status == 200
        assert await resp.read() == body
    (line,) = [line for line in await proxy.settled() if line["request_id"] == f"large-{framing}"]
    assert (line["outcome"], line["reason"]) == ("ok", "complete")
    assert line["prompt_tokens"] == 4321
    assert line["bytes_out"] == len(body)
