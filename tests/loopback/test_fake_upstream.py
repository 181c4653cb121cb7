"""The fake upstream on its own: realistic frames per dialect, each fault's raw bytes, the recorder."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from aiohttp.test_utils import TestServer
from yarl import URL

import proxy.tools.fake.scenarios as scenarios_module
from proxy.tools.fake import RECORDER, FakeSettings, Recorder, build_app, describe

AiohttpServer = Callable[..., Awaitable[TestServer]]
MESSAGES = [{"role": "user", "content": "Say something nice."}]
CHAT = {"model": "m", "messages": MESSAGES}
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat_completions": ("/v1/chat/completions", CHAT),
    "completions": ("/v1/completions", {"model": "m", "prompt": "Once"}),
    "responses": ("/v1/responses", {"model": "m", "input": "hello"}),
    "messages": ("/v1/messages", {"model": "m", "max_tokens": 16, "messages": MESSAGES}),
}
PREAMBLE = {"chat_completions": 1, "completions": 0, "responses": 4, "messages": 3}


class Fake:
    def __init__(self, server: TestServer, recorder: Recorder, http: aiohttp.ClientSession) -> None:
        self.server, self.recorder, self.http = server, recorder, http
        self.url = str(server.make_url("")).rstrip("/")

    def post(self, path: str, body: Any, **headers: str) -> Any:
        return self.http.post(self.url + path, json=body, headers=headers)


FakeFactory = Callable[..., Awaitable[Fake]]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


@pytest.fixture
async def make_fake(aiohttp_server: AiohttpServer, http: aiohttp.ClientSession) -> FakeFactory:
    async def start(**settings: Any) -> Fake:
        app = build_app(FakeSettings(**settings))
        # aiohttp 3.14's TestServer always serves with handler_cancellation=True (and rejects it twice).
        server = await aiohttp_server(app)
        return Fake(server, app[RECORDER], http)

    return start


@pytest.fixture
async def fake(make_fake: FakeFactory) -> Fake:
    return await make_fake()


def events(raw: bytes) -> list[tuple[str | None, str]]:
    """(event name, data) for each complete block; a non-data field line counts as its own name."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        name, data = None, []
        for line in block.split("\n"):
            field, _, value = line.partition(": ")
            if field == "data":
                data.append(value)
            else:
                name = value if field == "event" else field
        out.append((name, "\n".join(data)))
    return out


def datas(raw: bytes) -> list[Any]:
    return [json.loads(d) for _, d in events(raw) if d != "[DONE]"]


async def read_until_broken(resp: aiohttp.ClientResponse) -> tuple[bytes, BaseException | None]:
    body = b""
    try:
        async for chunk in resp.content.iter_any():
            body += chunk
    except aiohttp.ClientError as exc:
        return body, exc
    return body, None


# -- normal shapes ----------------------------------------------------------------------------------------


async def test_chat_stream_shape_and_request_id(fake: Fake) -> None:
    async with fake.post("/v1/chat/completions", {**CHAT, "stream": True}, **{"X-Request-Id": "abc"}) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["X-Request-Id"] == "abc"
        raw = await resp.read()
    assert raw.endswith(b"\n\ndata: [DONE]\n\n")
    chunks = datas(raw)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("usage" not in c for c in chunks)
    content = [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]]
    assert len(content) == 16
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 17 + ["stop"]
    assert {c["id"] for c in chunks} == {"chatcmpl-abc"}
    async with fake.post("/chat/completions", CHAT, **{"X-Request-Id": "abc"}) as resp:  # no /v1, whole
        whole = await resp.json()
    assert whole["choices"][0]["message"]["content"] == "".join(content)
    assert whole["usage"]["completion_tokens"] == 16


async def test_chat_include_usage_and_max_tokens(fake: Fake) -> None:
    body = {**CHAT, "stream": True, "max_tokens": 3, "n": 2, "stream_options": {"include_usage": True}}
    async with fake.post("/v1/chat/completions", body) as resp:
        chunks = datas(await resp.read())
    *rest, usage = chunks
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert all(c["usage"] is None for c in rest)
    assert [c["choices"][0]["index"] for c in rest[:2]] == [0, 1]
    assert [c["choices"][0]["finish_reason"] for c in rest[-2:]] == ["length", "length"]
    assert len(rest) == 2 + 3 * 2 + 2


@pytest.mark.parametrize(
    ("prompt", "k"), [("one", 1), (["a", "b"], 2), ([1, 2, 3], 1), ([[1], [2, 3], [4]], 3)], ids=str
)
@pytest.mark.parametrize("stream", [True, False])
async def test_completions_batch_indices(fake: Fake, prompt: Any, k: int, stream: bool) -> None:
    body = {"model": "m", "prompt": prompt, "n": 2, "max_tokens": 2, "stream": stream}
    async with fake.post("/v1/completions", body) as resp:
        raw = await resp.read()
    if stream:
        chunks = datas(raw)
        assert {c["choices"][0]["index"] for c in chunks} == set(range(2 * k))
        finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"] == "length"]
        assert sorted(finished) == list(range(2 * k))
    else:
        whole = json.loads(raw)
        assert [c["index"] for c in whole["choices"]] == list(range(2 * k))
        assert whole["usage"]["completion_tokens"] == 2 * 2 * k


async def test_responses_stream_and_whole(fake: Fake) -> None:
    async with fake.post("/v1/responses", {"model": "m", "input": "hi", "stream": True}) as resp:
        evs = events(await resp.read())
    names = [name for name, _ in evs]
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[4:20] == ["response.output_text.delta"] * 16
    assert names[20:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    payloads = [json.loads(data) for _, data in evs]
    assert [p["type"] for p in payloads] == names
    assert [p["sequence_number"] for p in payloads] == list(range(len(evs)))
    completed = payloads[-1]["response"]
    assert completed["status"] == "completed"
    assert completed["usage"]["output_tokens"] == 16
    async with fake.post("/v1/responses", {"model": "m", "input": "hi"}) as resp:
        whole = await resp.json()
    assert whole["output"][0]["content"][0]["text"] == payloads[20]["text"]


async def test_messages_stream_and_whole(fake: Fake) -> None:
    body = {"model": "m", "max_tokens": 5, "messages": MESSAGES}
    async with fake.post("/v1/messages", {**body, "stream": True}) as resp:
        evs = events(await resp.read())
    names = [name for name, _ in evs]
    assert names == ["message_start", "content_block_start", "ping", *["content_block_delta"] * 5,
                     "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    payloads = [json.loads(data) for _, data in evs]
    assert [p["type"] for p in payloads] == names
    assert payloads[0]["message"]["usage"]["input_tokens"] == 3
    assert payloads[-2]["delta"]["stop_reason"] == "max_tokens"
    assert payloads[-2]["usage"]["output_tokens"] == 5
    async with fake.post("/messages", body) as resp:
        whole = await resp.json()
    assert whole["content"][0]["text"] == "".join(p["delta"]["text"] for p in payloads[3:8])
    async with fake.post("/messages", {**body, "max_tokens": 1024}) as resp:  # mandatory there: only a cap
        whole = await resp.json()
    assert (whole["stop_reason"], whole["usage"]["output_tokens"]) == ("end_turn", 16)


async def test_embeddings_models_health(fake: Fake) -> None:
    async with fake.post("/v1/embeddings", {"model": "m", "input": ["a", "b"], "dimensions": 4}) as resp:
        emb = await resp.json()
    assert [len(d["embedding"]) for d in emb["data"]] == [4, 4]
    async with fake.post("/embeddings", {"model": "m", "input": ["a", "b"], "dimensions": 4}) as resp:
        assert await resp.json() == emb  # deterministic
    async with fake.http.get(fake.url + "/v1/models") as resp:
        assert (await resp.json())["data"][0]["id"] == "fake-model"
    async with fake.http.get(fake.url + "/health") as resp:
        assert resp.status == 200


async def test_echo_and_download(fake: Fake) -> None:
    url = URL(fake.url + "/_fake/echo/sub?a=%2F&b", encoded=True)
    async with fake.http.put(url, data=b"\x00\xffbody", headers={"X-Custom": "v"}) as resp:
        echo = await resp.json()
    assert (echo["method"], echo["path"], echo["query"]) == ("PUT", "/_fake/echo/sub", "a=%2F&b")
    assert echo["headers"]["X-Custom"] == "v"
    assert base64.b64decode(echo["body"]) == b"\x00\xffbody"
    async with fake.http.get(fake.url + "/_fake/download?bytes=300000&chunk=1000") as resp:
        data = await resp.read()
    assert data == bytes(i % 256 for i in range(300000))


async def test_openai_and_anthropic_sdks_stream_directly(fake: Fake) -> None:
    async with openai.AsyncOpenAI(base_url=fake.url + "/v1", api_key="x", max_retries=0) as client:
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)  # type: ignore[arg-type]
        assert isinstance(stream, openai.AsyncStream)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text.startswith("The fake upstream")
    aclient = anthropic.AsyncAnthropic(base_url=fake.url, api_key="x", max_retries=0)
    async with aclient, aclient.messages.stream(model="m", max_tokens=3, messages=MESSAGES) as mstream:  # type: ignore[arg-type]
        final = await mstream.get_final_message()
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 3


# -- the recorder ---------------------------------------------------------------------------------------


async def test_recorder_sees_the_client_leave_mid_stream(make_fake: FakeFactory) -> None:
    fake = await make_fake(token_rate=200.0, tokens=1000)
    async with fake.post("/v1/chat/completions", {**CHAT, "stream": True}, **{"X-Request-Id": "leaver"}) as resp:
        for _ in range(3):
            await resp.content.readuntil(b"\n\n")
        started = await fake.recorder.wait_started("leaver")
        assert started.finished_at is None
        resp.close()
    record = await fake.recorder.wait_finished("leaver")
    assert record.client_closed_at is not None
    assert not record.completed
    assert 3 <= record.events_sent < 1003
    assert (record.api, record.stream, record.scenario) == ("chat_completions", True, None)
    async with fake.http.get(fake.url + "/_fake/requests/leaver") as resp:
        over_http = await resp.json()
    assert over_http["client_closed_at"] == record.client_closed_at
    assert over_http["headers"]["X-Request-Id"] == "leaver"
    async with fake.http.get(fake.url + "/_fake/requests") as resp:
        assert [r["request_id"] for r in await resp.json()] == ["leaver"]
    async with fake.http.get(fake.url + "/_fake/requests/nobody") as resp:
        assert resp.status == 404


async def test_recorder_completed_and_timeouts(fake: Fake) -> None:
    async with fake.post("/v1/chat/completions", CHAT, **{"X-Request-Id": "ok"}) as resp:
        await resp.read()
    record = await fake.recorder.wait_finished("ok")
    assert record.completed
    assert record.client_closed_at is None
    assert record.events_sent == 0
    with pytest.raises(TimeoutError):
        await fake.recorder.wait_started("never", timeout=0.05)


async def test_cancel_while_awaiting_headers(fake: Fake) -> None:
    async def call() -> None:
        async with fake.post("/v1/chat/completions", CHAT, **{"x-fault": "late_headers;delay=30", "X-Request-Id": "w"}):
            pass

    task = asyncio.create_task(call())
    await fake.recorder.wait_started("w")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    record = await fake.recorder.wait_finished("w")
    assert record.client_closed_at is not None
    assert record.scenario == "late_headers"


# -- faults in a stream ------------------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["chat_completions", "messages"])
async def test_stray_503_block_lands_inside_the_body(fake: Fake, api: str) -> None:
    path, body = BODIES[api]
    async with fake.post(path, {**body, "stream": True}, **{"x-fault": "stray_503"}) as resp:
        assert resp.status == 200
        raw, error = await read_until_broken(resp)
    at = raw.index(b"HTTP/1.0 503")
    assert len(events(raw[:at])) == PREAMBLE[api]  # right after the preamble, before any content
    block = raw[at:]
    payload = b'{"error":{"message":"Service Unavailable: engine overloaded","type":"server_error","code":503}}'
    assert block == (
        b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
    )
    assert isinstance(error, aiohttp.ClientPayloadError)


@pytest.mark.parametrize("api", list(BODIES))
async def test_cut_and_no_terminal(fake: Fake, api: str) -> None:
    path, body = BODIES[api]
    async with fake.post(path, {**body, "stream": True}, **{"x-fault": "cut"}) as resp:
        raw, error = await read_until_broken(resp)
    assert len(events(raw)) == PREAMBLE[api] + 2
    assert raw.endswith(b"\n\n")
    assert isinstance(error, aiohttp.ClientPayloadError)
    async with fake.post(path, {**body, "stream": True, "model": "fault/cut;after=1;eof=1"}) as resp:
        assert len(events(await resp.read())) == 1
    async with fake.post(path, {**body, "stream": True}, **{"x-fault": "no_terminal"}) as resp:
        names = [name or data for name, data in events(await resp.read())]
    full = {"chat_completions": 19, "completions": 18, "responses": 24, "messages": 22}[api]
    assert len(names) == full - 1
    assert names[-1] not in ("[DONE]", "message_stop", "response.completed")


async def test_reset_is_a_tcp_rst(fake: Fake) -> None:
    reader, writer = await asyncio.open_connection(fake.server.host, fake.server.port)
    body = json.dumps({**CHAT, "stream": True}).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-fault: reset;after=1\r\n"
        b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    got = b""

    async def read_all() -> None:
        nonlocal got
        while chunk := await asyncio.wait_for(reader.read(65536), 5):
            got += chunk

    with pytest.raises(ConnectionResetError):
        await read_all()
    writer.close()
    assert b"200 OK" in got


async def test_reset_without_stream_drops_the_connection(fake: Fake) -> None:
    with pytest.raises(aiohttp.ClientError):
        async with fake.post("/v1/chat/completions", CHAT, **{"x-fault": "reset"}) as resp:
            await resp.read()


@pytest.mark.parametrize("api", ["chat_completions", "responses", "messages"])
async def test_error_after_first_then_silence(fake: Fake, api: str) -> None:
    path, body = BODIES[api]
    headers = {"x-fault": "error_after_first", "X-Request-Id": f"e-{api}"}
    async with fake.post(path, {**body, "stream": True}, **headers) as resp:
        got = [await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5) for _ in range(PREAMBLE[api] + 2)]
        name, data = events(got[-1])[0]
        assert events(got[-2])[0][0] != "error"
        assert (await fake.recorder.wait_started(f"e-{api}")).finished_at is None  # still open and silent
    error = json.loads(data)
    if api == "chat_completions":
        assert name is None
        assert error == {"error": {"message": "fake upstream: generation failed", "type": "InternalServerError",
                                   "param": None, "code": 500}}  # fmt: skip
    elif api == "messages":
        assert (name, error["type"], error["error"]["type"]) == ("error", "error", "api_error")
    else:
        assert (name, error["sequence_number"], error["error"]["code"]) == ("error", 5, "server_error")
    record = await fake.recorder.wait_finished(f"e-{api}")
    assert record.client_closed_at is not None
    assert record.events_sent == PREAMBLE[api] + 2


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        ("error_object_foreign", b'data: {"object":"error","message":"fake upstream: generation failed",'
                                 b'"type":"BadRequestError","param":null,"code":400}\n\n'),
        ("error_string", b'data: {"error":"fake upstream: generation failed","error_type":"generation"}\n\n'),
        ("error_field", b'error: {"message":"fake upstream: generation failed","type":"server_error",'
                        b'"code":500}\n\ndata: [DONE]\n\n'),
    ],
)  # fmt: skip
@pytest.mark.parametrize("api", ["chat_completions", "completions"])
async def test_foreign_error_frames(fake: Fake, fault: str, expected: bytes, api: str) -> None:
    path, body = BODIES[api]
    async with fake.post(path, {**body, "stream": True}, **{"x-fault": fault}) as resp:
        raw = await resp.read()
    assert raw.endswith(expected)
    before = datas(raw[: -len(expected)])
    assert len(before) == PREAMBLE[api] + 1
    first = before[-1]["choices"][0]
    assert first.get("delta", {}).get("content", first.get("text")) == "The"


async def test_stall_keeps_the_connection_silent(fake: Fake) -> None:
    headers = {"x-fault": "stall", "X-Request-Id": "st"}
    async with fake.post("/v1/chat/completions", {**CHAT, "stream": True}, **headers) as resp:
        for _ in range(2):
            await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 0.2)
    record = await fake.recorder.wait_finished("st")
    assert (record.events_sent, record.client_closed_at is not None) == (2, True)
    async with fake.post("/v1/chat/completions", {**CHAT, "stream": True}, **{"x-fault": "stall;hold=0"}) as resp:
        _, error = await read_until_broken(resp)
    assert isinstance(error, aiohttp.ClientPayloadError)


async def test_malformed_and_done_without_finish(fake: Fake) -> None:
    async with fake.post("/v1/chat/completions", {**CHAT, "stream": True}, **{"x-fault": "malformed_event"}) as resp:
        evs = events(await resp.read())
    bad = [i for i, (_, d) in enumerate(evs) if d == '{"choices": [']
    assert bad == [9]  # role chunk + 8 content events, then the broken one
    assert evs[-1][1] == "[DONE]"
    assert len(evs) == 20
    async with fake.post("/v1/completions", {**BODIES["completions"][1], "stream": True, "n": 2},
                         **{"x-fault": "done_without_finish"}) as resp:  # fmt: skip
        raw = await resp.read()
    assert raw.endswith(b"data: [DONE]\n\n")
    chunks = datas(raw)
    assert len(chunks) == 32
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
async def test_oversized_event(fake: Fake, api: str) -> None:
    path, body = BODIES[api]
    async with fake.post(path, {**body, "stream": True}, **{"x-fault": "oversized_event"}) as resp:
        evs = events(await resp.read())
    sizes = [len(data) for _, data in evs]
    assert sizes[PREAMBLE[api] + 1] == 9 * 1024 * 1024
    assert max(sizes[: PREAMBLE[api] + 1]) < 2000
    async with fake.post(path, {**body, "stream": True}, **{"x-fault": "oversized_event;size=5000;at=0"}) as resp:
        evs = events(await resp.read())
    assert len(evs[PREAMBLE[api]][1]) == 5000


async def test_slow_and_rate_header(fake: Fake) -> None:
    began = time.monotonic()
    async with fake.post(
        "/v1/chat/completions", {**CHAT, "stream": True}, **{"x-fault": "slow;rate=100;tokens=5"}
    ) as r:
        chunks = datas(await r.read())
    assert time.monotonic() - began >= 0.04  # 5 events at 100/s: the first at once, then 4 intervals
    assert len(chunks) == 1 + 5 + 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    async with fake.post("/v1/chat/completions", CHAT, **{"x-fake-rate": "fast"}) as resp:
        assert resp.status == 400


# -- whole-body faults -----------------------------------------------------------------------------------


async def test_whole_body_faults(fake: Fake) -> None:
    async def call(fault: str, path: str = "/v1/chat/completions", body: Any = CHAT) -> tuple[int, Any, bytes]:
        async with fake.post(path, body, **{"x-fault": fault}) as resp:
            return resp.status, resp.headers, await resp.read()

    assert (await call("null_200"))[::2] == (200, b"null")
    status, headers, raw = await call("empty_200", "/v1/embeddings", {"input": "x"})
    assert (status, raw) == (200, b"")
    status, _, raw = await call("error_in_200")
    assert status == 200
    assert json.loads(raw)["object"] == "error"
    assert json.loads(raw)["code"] == 400
    status, headers, raw = await call("html_502")
    assert status == 502
    assert headers["Content-Type"].startswith("text/html")
    assert raw.startswith(b"<html>\r\n<head><title>502 Bad Gateway</title></head>")
    assert b"nginx" in raw
    status, headers, raw = await call("upstream_429")
    assert (status, headers["Retry-After"], headers["x-ratelimit-remaining-requests"]) == (429, "1", "0")
    assert json.loads(raw)["error"]["type"] == "rate_limit_error"
    status, _, raw = await call("upstream_5xx_flat")
    assert status == 500
    assert json.loads(raw)["object"] == "error"
    status, _, raw = await call("upstream_detail")
    assert (status, json.loads(raw)) == (400, {"detail": "fake upstream: invalid request"})
    status, _, raw = await call("upstream_4xx_native;status=404", *BODIES["messages"])
    assert (status, json.loads(raw)["error"]["type"]) == (404, "not_found_error")


async def test_batch_missing_choice(fake: Fake) -> None:
    body = {"model": "fault/batch_missing_choice", "prompt": ["a", "b"], "n": 2}
    async with fake.post("/v1/completions", body) as resp:
        assert [c["index"] for c in (await resp.json())["choices"]] == [0, 1, 2]
    async with fake.post("/v1/completions", {**body, "model": "fault/batch_missing_choice;missing=0"}) as resp:
        assert [c["index"] for c in (await resp.json())["choices"]] == [1, 2, 3]


async def test_fail_first_then_success(make_fake: FakeFactory) -> None:
    fake = await make_fake(first_attempt_failures=2)
    statuses = []
    for _ in range(3):
        async with fake.post("/v1/chat/completions", CHAT, **{"x-fault": "fail_first"}) as resp:
            statuses.append((resp.status, resp.headers.get("Retry-After")))
            body = await resp.json()
    assert statuses == [(503, "0"), (503, "0"), (200, None)]
    assert body["choices"][0]["message"]["content"]
    headers = {"x-fault": "fail_first;mode=stream;failures=1", "x-fault-key": "k"}
    async with fake.post("/v1/chat/completions", {**CHAT, "stream": True}, **headers) as resp:
        raw, _ = await read_until_broken(resp)
    assert resp.status == 200
    assert b"HTTP/1.0 503" in raw
    async with fake.post("/v1/chat/completions", {**CHAT, "stream": True, "n": 1}, **headers) as resp:
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")


async def test_openai_sdk_retries_fail_first(fake: Fake) -> None:
    async with openai.AsyncOpenAI(base_url=fake.url + "/v1", api_key="x", max_retries=1) as client:
        whole = await client.chat.completions.create(model="fault/fail_first", messages=MESSAGES)  # type: ignore[arg-type]
    assert whole.choices[0].message.content
    assert [r.scenario for r in fake.recorder.all()] == ["fail_first", "fail_first"]


# -- bad requests -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "headers", "needle"),
    [
        ("/v1/chat/completions", CHAT, {"x-fault": "nope"}, "known faults: stray_503, cut"),
        ("/v1/chat/completions", CHAT, {"x-fault": "cut"}, "needs a streaming request"),
        ("/v1/chat/completions", {**CHAT, "stream": True}, {"x-fault": "cut;bogus=1"}, "no parameter bogus"),
        ("/v1/chat/completions", {**CHAT, "stream": True}, {"x-fault": "cut;after=x"}, "must be an integer"),
        ("/v1/responses", {"input": "x", "stream": True}, {"x-fault": "error_string"}, "does not apply"),
        ("/v1/completions", {"prompt": {"x": 1}}, {}, "'prompt' must be"),
        ("/v1/chat/completions", {**CHAT, "n": 0}, {}, "'n' must be"),
    ],
)
async def test_bad_requests_get_400_json(
    fake: Fake, path: str, body: Any, headers: dict[str, str], needle: str
) -> None:
    async with fake.post(path, body, **headers) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert needle in error["message"]
    assert error["type"] == "invalid_request_error"


async def test_bad_json_body(fake: Fake) -> None:
    async with fake.http.post(fake.url + "/v1/chat/completions", data=b"{nope") as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["message"] == "the request body is not valid JSON"
    async with fake.http.post(fake.url + "/v1/messages", data=b"[") as resp:
        assert (await resp.json())["type"] == "error"


def test_describe_matches_registry() -> None:
    """The registry is the one copy of the scenario table (docs/fake-upstream.md is generated from it)."""
    rows = describe()
    assert [row.name for row in rows] == list(scenarios_module.SCENARIOS)
    for row in rows:
        assert row.dialects
        assert row.summary


async def test_slow_body_sends_half_a_whole_body_then_the_rest(fake: Fake) -> None:
    async with fake.post("/v1/chat/completions", CHAT, **{"x-fault": "slow_body;delay=0"}) as resp:
        assert resp.headers["Content-Type"].startswith("application/json")
        body = await resp.json()
    assert body["choices"][0]["message"]["content"]
    headers = {"x-fault": "slow_body;delay=30", "X-Request-Id": "sb"}
    async with fake.post("/v1/chat/completions", CHAT, **headers) as resp:
        length = int(resp.headers["Content-Length"])
        half = await asyncio.wait_for(resp.content.readexactly(length // 2), 5)
        assert half.startswith(b"{")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(resp.content.readexactly(1), 0.2)
    assert (await fake.recorder.wait_finished("sb")).client_closed_at is not None
    async with fake.post("/v1/chat/completions", {**CHAT, "stream": True}, **{"x-fault": "slow_body"}) as resp:
        assert resp.status == 400  # a whole-body scenario
