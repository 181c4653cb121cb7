"""--resume-on-cut through the real proxy: a relay breaks the fake upstream's stream after five content
events (a cut, a stall, a stray `HTTP/1.0 503` block), and the official SDK reads one whole stream.

The fake does not continue a text (it starts its word list again), so these tests check the
mechanics: what the continuation request carries, what the client sees of the seam, the books, each
refusal, the limit, a continuation the backend refuses, and the flag off. The real tier
(`tests/real/test_resume_real.py`) proves the text against llama-server.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web
from support import FakeUpstream, Proxy, ProxyFactory, ServeUpstream
from support.cut_relay import CutRelay, Gate, read_gated

from proxy.tools.fake import FakeSettings, build_app

pytestmark = pytest.mark.asyncio

PROMPT = [{"role": "user", "content": "Say something."}]
AFTER = 5  # content events the relay lets through before it breaks a stream


async def relay_to(backend: str, plan: list[str | None], relays: list[CutRelay]) -> CutRelay:
    relay = await CutRelay(backend, plan, after=AFTER, gate=Gate(AFTER)).start()
    relays.append(relay)
    return relay


async def chat(base: str, gate: Gate | None = None, **extra: Any) -> list[dict[str, Any]]:
    """One streamed chat answer through the openai SDK, as dumped chunks (raises what the SDK raises);
    each content event it receives opens the relay's `gate` a step."""
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        fields: dict[str, Any] = {"max_tokens": 12, "stream_options": {"include_usage": True}, **extra}
        stream = await client.chat.completions.create(model="fake-model", messages=PROMPT, stream=True, **fields)
        return await read_gated(stream, gate)


async def words_tokenizer(request: web.Request) -> web.Response:
    """vLLM's `/tokenize`, counting a token per word."""
    count = len((await request.json())["prompt"].split())
    return web.json_response({"count": count, "max_model_len": 4096, "tokens": list(range(count))})


def text_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def resumes(proxy: Proxy, reason: str, result: str, api: str = "chat_completions") -> float:
    return proxy.sample("streamwarden_stream_resumes_total", {"api": api, "reason": reason, "result": result})


@pytest.mark.parametrize(("how", "reason"), [("close", "stream_cut"), ("stall", "stall_timeout"),
                                              ("stray", "stray_http_block")])
async def test_a_broken_stream_is_continued_and_the_client_sees_one_stream(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, relays: list[CutRelay], how: str, reason: str
) -> None:
    relay = await relay_to(fake_upstream.url, [how], relays)
    proxy = await make_proxy(upstream=relay.url, resume_on_cut=1, idle_timeout=1.0)
    extra: dict[str, Any] = {"temperature": 0, "seed": 7, "extra_headers": {"X-Trace-Me": "yes"}}
    direct = await chat(fake_upstream.url, **extra)
    chunks = await chat(proxy.url, relay.gate, **extra)
    assert relay.broken == 1
    assert len(relay.bodies) == 2
    first, second = (orjson.loads(body) for body in relay.bodies)
    so_far = text_of(chunks)[: len(second["messages"][-1]["content"])]
    assert second["messages"] == [*PROMPT, {"role": "assistant", "content": so_far}]
    assert len(so_far) > 0
    assert (second["continue_final_message"], second["add_generation_prompt"]) == (True, False)
    assert second["max_tokens"] == first["max_tokens"] - AFTER
    assert {k: v for k, v in second.items() if k not in ("messages", "max_tokens", "continue_final_message",
                                                         "add_generation_prompt")} == {
        k: v for k, v in first.items() if k not in ("messages", "max_tokens")}
    # One stream: the answer straight from the fake (which continues a prefix of its own answer), the
    # first answer's id everywhere, one role chunk, the usage of an uncut answer.
    assert text_of(chunks) == text_of(direct)
    assert chunks[-1]["usage"] == direct[-1]["usage"]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert {c["created"] for c in chunks} == {chunks[0]["created"]}
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")) == 1
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["length"]
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"], line["resumes"]) == ("ok", "complete", 1)
    assert line["completion_tokens"] == 12
    assert resumes(proxy, reason, "resumed") == 1


REFUSED = [
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
    {"n": 2},
    {"response_format": {"type": "json_object"}},
    {"logprobs": True, "top_logprobs": 2},
    {"extra_body": {"guided_regex": "[a-z ]+"}},
]


@pytest.mark.parametrize("extra", REFUSED, ids=["tools", "n", "response_format", "logprobs", "guided"])
async def test_requests_that_cannot_be_continued_end_as_today(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, relays: list[CutRelay], extra: dict[str, Any]
) -> None:
    relay = await relay_to(fake_upstream.url, ["close"], relays)
    proxy = await make_proxy(upstream=relay.url, resume_on_cut=3)
    with pytest.raises(openai.APIError) as raised:
        await chat(proxy.url, relay.gate, **extra)
    assert raised.value.code == "stream_cut"
    assert len(relay.bodies) == 1
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"], line["resumes"]) == ("error", "stream_cut", 0)
    assert line["resume_refusal"]  # the rule that said no, for the operator
    assert resumes(proxy, "stream_cut", "refused") == 1


async def test_the_limit_ends_the_stream_with_the_failure_it_broke_with(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, relays: list[CutRelay]
) -> None:
    relay = await relay_to(fake_upstream.url, ["close", "close", "close"], relays)
    proxy = await make_proxy(upstream=relay.url, resume_on_cut=2)
    with pytest.raises(openai.APIError) as raised:
        await chat(proxy.url, relay.gate, max_tokens=40)
    assert raised.value.code == "stream_cut"
    assert len(relay.bodies) == 3
    bodies = [orjson.loads(body) for body in relay.bodies]
    assert [b["max_tokens"] for b in bodies] == [40, 40 - AFTER, 40 - 2 * AFTER]
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"], line["resumes"]) == ("error", "stream_cut", 2)
    assert line["resume_refusal"] == "the limit of 2 continuations was reached"
    # Each continuation counted once: both broke in turn, and none was refused.
    assert [resumes(proxy, "stream_cut", result) for result in ("resumed", "failed", "refused")] == [0, 2, 0]


async def test_flag_off_nothing_changes(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, relays: list[CutRelay]
) -> None:
    relay = await relay_to(fake_upstream.url, ["close"], relays)
    proxy = await make_proxy(upstream=relay.url)
    with pytest.raises(openai.APIError) as raised:
        await chat(proxy.url, relay.gate)
    assert raised.value.code == "stream_cut"
    assert len(relay.bodies) == 1
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"]) == ("error", "stream_cut")
    assert "resumes" not in line
    assert resumes(proxy, "stream_cut", "refused") == 0


async def test_a_continuation_the_backend_refuses_ends_as_today(
    make_proxy: ProxyFactory, serve_upstream: ServeUpstream, relays: list[CutRelay]
) -> None:
    """A backend that answers the continuation 400 (vLLM: a template that cannot continue a message)."""
    seen: list[dict[str, Any]] = []

    async def backend(request: web.Request) -> web.StreamResponse:
        if request.path == "/tokenize":  # (a backend with a tokenizer: one token per word)
            return await words_tokenizer(request)
        seen.append(await request.json())
        if len(seen) > 1:
            error = {"error": {"message": "cannot continue", "type": "BadRequestError", "code": 400}}
            return web.json_response(error, status=400)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"id":"c1","created":1,"model":"m","object":"chat.completion.chunk",'
                             b'"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n')
        for word in ["one ", "two ", "three ", "four ", "five ", "six "]:
            chunk = {"id": "c1", "created": 1, "model": "m", "object": "chat.completion.chunk",
                     "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        return response

    relay = await relay_to(await serve_upstream(backend), ["close"], relays)
    proxy = await make_proxy(upstream=relay.url, resume_on_cut=2)
    with pytest.raises(openai.APIError) as raised:
        await chat(proxy.url, relay.gate)
    assert raised.value.code == "stream_cut"
    assert seen[1]["messages"][-1] == {"role": "assistant", "content": "one two three four five "}
    assert len(seen) == 2  # a 4xx is not tried again
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"], line["resumes"]) == ("error", "stream_cut", 0)
    assert resumes(proxy, "stream_cut", "failed") == 1


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def word_chunk(word: str, finish: str | None = None) -> bytes:
    return sse({"id": "c1", "created": 1, "model": "m", "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": word} if word else {}, "finish_reason": finish}]})


async def stream_words(request: web.Request, words: list[str], finish: bool) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(sse({"id": "c1", "created": 1, "model": "m", "object": "chat.completion.chunk",
                              "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
    for word in words:
        await response.write(word_chunk(word))
    if finish:
        await response.write(word_chunk("", "stop") + b"data: [DONE]\n\n")
    return response


async def test_a_continuation_answered_with_a_retryable_status_is_tried_again(
    make_proxy: ProxyFactory, serve_upstream: ServeUpstream, relays: list[CutRelay]
) -> None:
    seen: list[dict[str, Any]] = []

    async def backend(request: web.Request) -> web.StreamResponse:
        if request.path == "/tokenize":  # (a backend with a tokenizer: one token per word)
            return await words_tokenizer(request)
        seen.append(await request.json())
        if len(seen) == 2:
            error = {"error": {"message": "busy", "type": "server_error", "code": 503}}
            return web.json_response(error, status=503, headers={"Retry-After": "0"})
        if len(seen) == 3:
            return await stream_words(request, ["six"], finish=True)
        return await stream_words(request, ["one ", "two ", "three ", "four ", "five ", "six "], finish=False)

    relay = await relay_to(await serve_upstream(backend), ["close"], relays)
    proxy = await make_proxy(upstream=relay.url, resume_on_cut=2)
    chunks = await chat(proxy.url, relay.gate)
    assert text_of(chunks) == "one two three four five six"
    assert seen[1] == seen[2]  # the same continuation, sent again
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"], line["resumes"]) == ("ok", "complete", 1)
    assert (resumes(proxy, "stream_cut", "failed"), resumes(proxy, "stream_cut", "resumed")) == (1, 1)


async def test_a_client_that_leaves_during_a_continuation_cancels_it(
    make_proxy: ProxyFactory, serve_upstream: ServeUpstream, relays: list[CutRelay]
) -> None:
    continued = asyncio.Event()
    cancelled = asyncio.Event()
    seen = 0

    async def backend(request: web.Request) -> web.StreamResponse:
        if request.path == "/tokenize":  # (a backend with a tokenizer: one token per word)
            return await words_tokenizer(request)
        nonlocal seen
        seen += 1
        if seen == 1:
            return await stream_words(request, ["one ", "two ", "three ", "four ", "five ", "six "], finish=False)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(word_chunk("six "))
        continued.set()
        try:
            await asyncio.Event().wait()  # a long generation, until the proxy closes the connection
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return response

    relay = await relay_to(await serve_upstream(backend), ["close"], relays)
    proxy = await make_proxy(upstream=relay.url, resume_on_cut=1)
    async with aiohttp.ClientSession() as http:
        body = {"model": "m", "stream": True, "messages": PROMPT}
        async with http.post(proxy.url + "/v1/chat/completions", json=body) as resp:
            received = b""
            async with asyncio.timeout(10):
                while b"six" not in received:
                    received += await resp.content.readany()
                    if b"five" in received and relay.gate is not None:
                        relay.gate.open.set()  # the client has the five words before the cut
        # (the client closed its connection here, after the continuation's first text)
    async with asyncio.timeout(10):
        await cancelled.wait()
    assert continued.is_set()
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"], line["resumes"]) == ("aborted", "client_disconnect", 1)
    assert line["upstream_cancelled"] is True


async def test_completions_continue_the_prompt(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, relays: list[CutRelay]
) -> None:
    relay = await relay_to(fake_upstream.url, ["close"], relays)
    proxy = await make_proxy(upstream=relay.url, resume_on_cut=1)
    async with openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        stream = await client.completions.create(model="fake-model", prompt="Once", stream=True, max_tokens=12,
                                                 stream_options={"include_usage": True})
        chunks = await read_gated(stream, relay.gate)
    first, second = (orjson.loads(body) for body in relay.bodies)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert second["prompt"].startswith("Once")
    assert text.startswith(second["prompt"][len("Once"):])
    assert second["max_tokens"] == first["max_tokens"] - AFTER
    assert "continue_final_message" not in second
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"], line["resumes"]) == ("ok", "complete", 1)
    assert resumes(proxy, "stream_cut", "resumed", api="completions") == 1


def stray(retry_after: str) -> bytes:
    body = b'{"error":{"message":"overloaded","code":503}}'
    return (b"HTTP/1.0 503 Service Unavailable\r\nRetry-After: " + retry_after.encode() + b"\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def stray_then_whole(retry_after: str, seen: list[dict[str, Any]]) -> Any:
    """A backend whose first answer breaks with a stray 503 block after six words; later ones finish."""

    async def backend(request: web.Request) -> web.StreamResponse:
        if request.path == "/tokenize":  # (a backend with a tokenizer: one token per word)
            return await words_tokenizer(request)
        seen.append(await request.json())
        if len(seen) > 1:
            return await stream_words(request, ["seven"], finish=True)
        response = await stream_words(request, ["one ", "two ", "three ", "four ", "five ", "six "], finish=False)
        await response.write(stray(retry_after))
        await asyncio.Event().wait()  # and then nothing: the block is the end of this answer
        return response

    return backend


async def test_a_stray_blocks_retry_after_is_honoured(
    make_proxy: ProxyFactory, serve_upstream: ServeUpstream
) -> None:
    seen: list[dict[str, Any]] = []
    proxy = await make_proxy(upstream=await serve_upstream(stray_then_whole("1", seen)), resume_on_cut=1)
    loop = asyncio.get_running_loop()
    started = loop.time()
    chunks = await chat(proxy.url)
    assert loop.time() - started >= 1.0  # (a lower bound: only a proxy that did not wait is faster)
    assert text_of(chunks) == "one two three four five six seven"
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"], line["resumes"]) == ("ok", "complete", 1)
    assert "upstream_message" not in line  # the mended break is not what the exchange ended with
    assert resumes(proxy, "stray_http_block", "resumed") == 1


async def test_a_retry_after_beyond_the_first_byte_timeout_is_not_waited_for(
    make_proxy: ProxyFactory, serve_upstream: ServeUpstream
) -> None:
    seen: list[dict[str, Any]] = []
    upstream = await serve_upstream(stray_then_whole("3600", seen))
    proxy = await make_proxy(upstream=upstream, resume_on_cut=1, first_byte_timeout=30)
    with pytest.raises(openai.APIError) as raised:
        await chat(proxy.url)
    assert str(raised.value.message) == "overloaded"  # the block's own error, as without the flag
    assert len(seen) == 1
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"], line["resumes"]) == ("error", "stray_http_block", 0)
    assert line["upstream_message"] == "overloaded"
    assert resumes(proxy, "stray_http_block", "refused") == 1


async def test_shutdown_ends_the_wait_for_a_continuation(
    make_proxy: ProxyFactory, serve_upstream: ServeUpstream
) -> None:
    seen: list[dict[str, Any]] = []
    upstream = await serve_upstream(stray_then_whole("20", seen))
    proxy = await make_proxy(upstream=upstream, resume_on_cut=1, drain_timeout=0.2)
    async with aiohttp.ClientSession() as http:
        body = {"model": "m", "stream": True, "messages": PROMPT}
        async with http.post(proxy.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "r1"}) as resp:
            received = b""
            async with asyncio.timeout(10):
                while b"six" not in received:
                    received += await resp.content.readany()
                proxy.server.request_stop()  # the proxy waits out the block's Retry-After: 20 s
                shutting = asyncio.create_task(proxy.server.shutdown())
                received += await resp.content.read()
                await shutting
    assert b'"code":"shutdown"' in received
    assert received.endswith(b"data: [DONE]\n\n")
    assert len(seen) == 1
    line = await proxy.line_for("r1")
    assert (line["outcome"], line["reason"]) == ("error", "shutdown")


async def test_an_error_frame_with_a_retryable_status_is_continued(
    make_proxy: ProxyFactory, serve_upstream: ServeUpstream
) -> None:
    seen: list[dict[str, Any]] = []

    async def backend(request: web.Request) -> web.StreamResponse:
        if request.path == "/tokenize":  # (a backend with a tokenizer: one token per word)
            return await words_tokenizer(request)
        seen.append(await request.json())
        if len(seen) > 1:
            return await stream_words(request, ["three"], finish=True)
        response = await stream_words(request, ["one ", "two "], finish=False)
        error = {"error": {"message": "engine restarting", "type": "InternalServerError", "code": 503}}
        await response.write(sse(error) + b"data: [DONE]\n\n")  # vLLM's shape
        return response

    proxy = await make_proxy(upstream=await serve_upstream(backend), resume_on_cut=1)
    chunks = await chat(proxy.url)
    assert text_of(chunks) == "one two three"
    assert seen[1]["messages"][-1] == {"role": "assistant", "content": "one two "}
    assert resumes(proxy, "upstream_error_frame", "resumed") == 1


async def test_completions_with_token_ids_are_continued_token_for_token(
    make_proxy: ProxyFactory, serve_upstream: ServeUpstream, relays: list[CutRelay]
) -> None:
    """vLLM with `return_token_ids`: the continuation's prompt is the prompt's ids and the generated ids."""
    seen: list[dict[str, Any]] = []

    def chunk(text: str, ids: list[int], finish: str | None = None, **extra: Any) -> bytes:
        choice = {"index": 0, "text": text, "token_ids": ids, "finish_reason": finish, **extra}
        return sse({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]})

    async def backend(request: web.Request) -> web.StreamResponse:
        if request.path == "/tokenize":  # (a backend with a tokenizer: one token per word)
            return await words_tokenizer(request)
        seen.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if len(seen) == 1:
            await response.write(chunk(" upon", [101], prompt_token_ids=[1, 7, 8]))
            for text, ids in [(" a", [102]), ("", [103]), ("é", [104]), (" time", [105]), (",", [106])]:
                await response.write(chunk(text, ids))
        else:
            await response.write(chunk(" there", [107], prompt_token_ids=seen[-1]["prompt"]))
            await response.write(chunk("", [], "length") + b"data: [DONE]\n\n")
        return response

    relay = await relay_to(await serve_upstream(backend), ["close"], relays)
    proxy = await make_proxy(upstream=relay.url, resume_on_cut=1)
    async with openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        stream = await client.completions.create(model="m", prompt="Once", stream=True, max_tokens=10,
                                                 extra_body={"return_token_ids": True})
        chunks = await read_gated(stream, relay.gate)
    # The relay cut after five texts, which took six tokens (one ended inside the "é"): six are spent.
    assert seen[1]["prompt"] == [1, 7, 8, 101, 102, 103, 104, 105, 106]
    assert seen[1]["max_tokens"] == 10 - 6
    assert "".join(c["choices"][0]["text"] for c in chunks) == " upon aé time, there"
    assert chunks[-2]["choices"][0]["prompt_token_ids"] == [1, 7, 8]  # the first answer's, on the seam too


async def test_keep_alive_comments_flow_while_a_continuation_is_awaited(
    make_proxy: ProxyFactory, serve_upstream: ServeUpstream
) -> None:
    seen: list[dict[str, Any]] = []
    upstream = await serve_upstream(stray_then_whole("1", seen))
    proxy = await make_proxy(upstream=upstream, resume_on_cut=1, keepalive_interval=0.2)
    async with aiohttp.ClientSession() as http:
        body = {"model": "m", "stream": True, "messages": PROMPT}
        async with http.post(proxy.url + "/v1/chat/completions", json=body) as resp:
            received = await resp.content.read()
    seam = received[received.index(b"six") : received.index(b"seven")]
    assert b": keep-alive\n\n" in seam  # a second of waiting at 0.2 s: comments, whatever the machine's load
    assert received.endswith(b"data: [DONE]\n\n")


async def test_a_backend_that_echoes_the_prefix_is_stitched_without_it(
    make_proxy: ProxyFactory, aiohttp_server: Any, relays: list[CutRelay]
) -> None:
    """llama-server's plain prefill, as the fake's `prefill_echo` quirk plays it: the prefix comes back
    whole in the first delta, and the client must not see it twice."""
    echoing = await aiohttp_server(build_app(FakeSettings(quirk="prefill_echo")))
    backend = str(echoing.make_url("")).rstrip("/")
    relay = await relay_to(backend, ["close"], relays)
    proxy = await make_proxy(upstream=relay.url, resume_on_cut=1)
    direct = await chat(backend)
    chunks = await chat(proxy.url, relay.gate)
    assert len(relay.bodies) == 2
    assert text_of(chunks) == text_of(direct)
    assert chunks[-1]["usage"] == direct[-1]["usage"]


@pytest.mark.parametrize("resume_on_cut", [1, 0], ids=["flag-on", "flag-off"])
async def test_the_kept_body_counts_in_the_body_budget_until_the_stream_ends(
    make_proxy: ProxyFactory, serve_upstream: ServeUpstream, resume_on_cut: int
) -> None:
    """The bytes kept for a continuation are memory the shared bound must see."""
    release = asyncio.Event()

    async def backend(request: web.Request) -> web.StreamResponse:
        if request.path == "/tokenize":  # (a backend with a tokenizer: one token per word)
            return await words_tokenizer(request)
        await request.read()
        response = await stream_words(request, ["one ", "two "], finish=False)
        await release.wait()
        await response.write(word_chunk("", "stop") + b"data: [DONE]\n\n")
        return response

    proxy = await make_proxy(upstream=await serve_upstream(backend), resume_on_cut=resume_on_cut)
    body = orjson.dumps({"model": "m", "stream": True, "messages": [*PROMPT] * 500})
    budget = proxy.state.body_budget
    async with aiohttp.ClientSession() as http, http.post(
        proxy.url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    ) as resp:
        seen = b""
        while b"two" not in seen:
            seen += await asyncio.wait_for(resp.content.readany(), 10)
        held = budget.used  # (the stream is open: the upstream waits for `release`)
        release.set()
        await resp.content.read()
    await proxy.settled()
    assert held == (len(body) if resume_on_cut else 0)
    assert budget.used == 0


async def test_the_continuation_carries_the_clients_own_bytes(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, relays: list[CutRelay]
) -> None:
    """A 30-digit integer in the client's body reaches the backend as the same integer in the continuation."""
    relay = await relay_to(fake_upstream.url, ["close"], relays)
    proxy = await make_proxy(upstream=relay.url, resume_on_cut=1)
    big = 123456789012345678901234567890
    await chat(proxy.url, relay.gate, extra_body={"user_tag": big})
    first, second = relay.bodies
    assert str(big).encode() in first
    assert b'"user_tag":' + str(big).encode() in second.replace(b" ", b"")
    assert orjson.loads(second)["max_tokens"] == 12 - AFTER


async def test_vllms_empty_deltas_are_counted_as_tokens(
    make_proxy: ProxyFactory, serve_upstream: ServeUpstream
) -> None:
    """A cut seen against real vLLM: 22 tokens streamed, 17 of them `"content": ""` chunks (bytes held
    back inside a character), for max_tokens 64: the continuation asked 59 and the client got 81."""
    seen: list[dict[str, Any]] = []
    pieces = ["\ufffdWh", *[""] * 3, " a", *[""] * 4, "y", *[""] * 7, "b", *[""] * 3, "c"]

    def piece(text: str, finish: str | None = None) -> bytes:
        return sse({"id": "chatcmpl-v", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
                    "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish,
                                 "token_ids": None}]})

    async def backend(request: web.Request) -> web.StreamResponse:
        if request.path == "/tokenize":  # (a backend with a tokenizer: one token per word)
            return await words_tokenizer(request)
        seen.append(body := await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        if len(seen) == 1:
            await response.write(sse({"id": "chatcmpl-v", "object": "chat.completion.chunk", "created": 1,
                                      "model": "tiny", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                                          "content": ""}}]}))
            for text in pieces:
                await response.write(piece(text))
            await response.write(stray("0"))
            await asyncio.Event().wait()
        rest = body["max_tokens"]
        for _ in range(rest - 1):
            await response.write(piece(" z"))
        await response.write(piece(" z", "length"))
        usage = {"prompt_tokens": 17 + 9, "completion_tokens": rest, "total_tokens": 26 + rest}
        await response.write(sse({"id": "chatcmpl-w", "object": "chat.completion.chunk", "created": 2,
                                  "model": "tiny", "choices": [], "usage": usage}) + b"data: [DONE]\n\n")
        return response

    proxy = await make_proxy(upstream=await serve_upstream(backend), resume_on_cut=1)
    chunks = await chat(proxy.url, max_tokens=64)
    assert len(pieces) == 22
    assert seen[1]["max_tokens"] == 42
    assert chunks[-1]["usage"]["completion_tokens"] == 64
    assert resumes(proxy, "stray_http_block", "resumed") == 1
