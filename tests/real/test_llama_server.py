"""streamwarden in front of llama.cpp's own `llama-server`, a backend nobody here wrote.

With the official SDKs, every API llama-server speaks gives the same answer, event for event,
directly and through the proxy (ids, timestamps and llama.cpp's `timings` aside: greedy decoding, a
fixed seed and no prompt cache make the rest deterministic); its usage reaches the proxy's metrics;
a client that abandons a long stream makes the server stop, as its own `/metrics` shows; the faults
llama-server produces by itself reach the client as the dialect defines them; and `--cancel-hook
llama-conversation` stops the generation that a conversation id would otherwise keep running.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest
from llama import LlamaServer, parse_metric
from support import Proxy, ProxyFactory
from support.fidelity import abandon_after, normalise, openai_client

from proxy.config import parse_hooks

pytestmark = pytest.mark.real

MODEL = "tiny"
PROMPT = "Say something."
VOLATILE = frozenset({"id", "created", "created_at", "completed_at", "system_fingerprint", "timings", "item_id"})
BOUND = 30.0  # seconds for any one exchange with the tiny model; only a hang exceeds it


def anthropic_client(base: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=base, api_key="unused", max_retries=0, timeout=BOUND)


async def ask(base: str, api: str, stream: bool, max_tokens: int = 24, prompt: str = PROMPT) -> list[Any]:
    """One request through the official SDK; the answer as a list of dumped objects (events or one body)."""
    common: dict[str, Any] = {"model": MODEL, "temperature": 0}
    result: Any
    if api == "messages":
        async with anthropic_client(base) as ant:
            result = await ant.messages.create(  # (this SDK has no temperature parameter)
                model=MODEL, max_tokens=max_tokens, messages=[{"role": "user", "content": prompt}], stream=stream,
                extra_body={"temperature": 0},
            )
            return [e.model_dump() async for e in result] if stream else [result.model_dump()]
    async with openai_client(base, BOUND) as oai:
        usage: dict[str, Any] = {"stream_options": {"include_usage": True}} if stream else {}
        if api == "chat_completions":
            result = await oai.chat.completions.create(
                **common, seed=42, max_tokens=max_tokens, messages=[{"role": "user", "content": prompt}],
                stream=stream, **usage,
            )
        elif api == "completions":
            result = await oai.completions.create(
                **common, seed=42, max_tokens=max_tokens, prompt=prompt, stream=stream, **usage
            )
        else:
            result = await oai.responses.create(**common, max_output_tokens=max_tokens, input=prompt, stream=stream)
        return [e.model_dump() async for e in result] if stream else [result.model_dump()]


def last_usage(answer: list[Any]) -> dict[str, Any]:
    found: list[dict[str, Any]] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            if isinstance(value.get("usage"), dict):
                found.append(value["usage"])
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(answer)
    assert found, answer
    return found[-1]


def tokens(proxy: Proxy, api: str, kind: str) -> float:
    labels = {"api": api, "model": MODEL, "kind": kind, "source": "usage"}
    return proxy.sample("streamwarden_tokens_total", labels)


APIS = ["chat_completions", "completions", "responses", "messages"]


# ---- the same answer, event for event ----------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("api", APIS)
async def test_same_answer_direct_and_through(make_proxy: ProxyFactory, llama: LlamaServer, api: str,
                                              stream: bool) -> None:  # fmt: skip
    proxy = await make_proxy(upstream=llama.url)
    direct = await ask(llama.url, api, stream)
    through = await ask(proxy.url, api, stream)
    assert normalise(through, VOLATILE) == normalise(direct, VOLATILE)
    assert len(through) > (20 if stream else 0)  # a real stream: one event per token, and more
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"], line["api"], line["stream"]) == ("ok", "complete", api, stream)
    usage = last_usage(through)
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    assert completion == 24  # random weights never pick EOS: the answer runs to max_tokens
    assert (line["completion_tokens"], line["usage_source"]) == (completion, "usage")
    assert tokens(proxy, api, "completion") == completion
    if api != "messages":  # Anthropic's input count is on message_start, checked by the log line
        assert tokens(proxy, api, "prompt") == usage.get("prompt_tokens", usage.get("input_tokens"))
    assert line["prompt_tokens"]


# ---- abandoning a stream stops the server --------------------------------------------------------------


async def predicted(http: aiohttp.ClientSession, server: LlamaServer, within: float = BOUND) -> float:
    """llama-server's own count of generated tokens, once no slot is busy (it is booked on release)."""
    async with asyncio.timeout(within):
        while True:
            async with http.get(server.url + "/slots") as resp:
                slots = await resp.json()
            if not any(slot.get("is_processing") for slot in slots):
                break
            await asyncio.sleep(0.05)
        async with http.get(server.url + "/metrics") as resp:
            return parse_metric(await resp.text(), "llamacpp:tokens_predicted_total")


# The stream a client abandons: 400 tokens asked, far more than it reads before it leaves.
ABANDONED = {"model": MODEL, "stream": True, "max_tokens": 400, "temperature": 0,
             "messages": [{"role": "user", "content": PROMPT}]}  # fmt: skip


async def generated_after_close(
    server: LlamaServer, base: str, headers: dict[str, str] | None = None, *, within: float = BOUND
) -> float:
    """`within` bounds the wait for the slot to be free: a stream left to run to its end takes longest."""
    received = 20
    async with aiohttp.ClientSession() as http:
        before = await predicted(http, server)
        await abandon_after(base, ABANDONED, received, within=BOUND, headers=headers)
        await asyncio.sleep(0)  # (the count is read once the slot is free, however long that takes)
        return await predicted(http, server, within) - before - received


async def test_abandoned_stream_stops_the_server(make_proxy: ProxyFactory, llama_wide: LlamaServer) -> None:
    proxy = await make_proxy(upstream=llama_wide.url)
    direct = await generated_after_close(llama_wide, llama_wide.url)
    through = await generated_after_close(llama_wide, proxy.url)
    print(f"\ntokens generated after the client's close: direct {direct:.0f}, through streamwarden {through:.0f}")
    # Run to its end the stream would have made 380 more tokens; a close stops it within a few.
    assert through < 100
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"], line["upstream_cancelled"]) == ("aborted", "client_disconnect", True)


@pytest.mark.timeout(600)  # the half without the hook lets 380 tokens run out: minutes on a busy machine
async def test_conversation_hook_stops_what_a_close_does_not(
    make_proxy: ProxyFactory, llama_wide: LlamaServer
) -> None:
    """With X-Conversation-Id llama-server keeps generating for replay after a close; the hook stops it."""
    plain = await make_proxy(upstream=llama_wide.url)
    hooked = await make_proxy(upstream=llama_wide.url, cancel_hook=parse_hooks(["llama-conversation"]))
    without = await generated_after_close(llama_wide, plain.url, {"X-Conversation-Id": "conv-plain"}, within=300)
    with_hook = await generated_after_close(llama_wide, hooked.url, {"X-Conversation-Id": "conv-hooked"})
    print(f"\ntokens generated after the close with X-Conversation-Id: without hook {without:.0f}, "
          f"with --cancel-hook llama-conversation {with_hook:.0f}")  # fmt: skip
    assert without > 150  # the backend's own behaviour, which the hook exists for
    assert with_hook < 100
    assert with_hook < without / 2
    lines = hooked.log_lines("cancel_hook")
    assert [(line["hook"], line["status"], line["failure"]) for line in lines] == [("llama-conversation", 204, None)]
    labels = {"api": "chat_completions", "reason": "cancel_hook"}
    assert hooked.sample("streamwarden_upstream_cancellations_total", labels) == 1


# ---- llama-server's own faults, as the dialect defines them ---------------------------------------------

LONG = "x " * 600  # about 1,200 tokens for a 512-token context


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("api", APIS)
async def test_over_long_prompt_is_the_dialects_400(make_proxy: ProxyFactory, llama: LlamaServer, api: str,
                                                    stream: bool) -> None:  # fmt: skip
    proxy = await make_proxy(upstream=llama.url)
    error = openai.BadRequestError if api != "messages" else anthropic.BadRequestError
    with pytest.raises(error) as info:
        await ask(proxy.url, api, stream, prompt=LONG)
    exc = info.value
    assert exc.status_code == 400
    assert "exceeds the available context size" in exc.message
    if isinstance(exc, anthropic.BadRequestError):
        assert exc.body["error"]["type"] == "invalid_request_error"  # reshaped: llama answers OpenAI's shape
    else:
        assert exc.type == "exceed_context_size_error"  # llama.cpp's own OpenAI-shaped error passes as is
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"], line["status"]) == ("error", "upstream_4xx", 400)


RAW_PATHS = {"chat_completions": "/v1/chat/completions", "completions": "/v1/completions",
             "responses": "/v1/responses", "messages": "/v1/messages"}  # fmt: skip


async def raw_post(http: aiohttp.ClientSession, url: str, data: bytes) -> tuple[int, dict[str, Any]]:
    async with http.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
        return resp.status, await resp.json(content_type=None)


@pytest.mark.parametrize("api", APIS)
async def test_malformed_json_reaches_the_client_in_its_dialect(
    make_proxy: ProxyFactory, llama: LlamaServer, api: str
) -> None:
    """llama-server answers a body that is not JSON with a 500 (not a 400): passed on, in the dialect's shape."""
    proxy = await make_proxy(upstream=llama.url)
    async with aiohttp.ClientSession() as http:
        direct_status, direct = await raw_post(http, llama.url + RAW_PATHS[api], b'{"messages": [')
        status, body = await raw_post(http, proxy.url + RAW_PATHS[api], b'{"messages": [')
    assert status == direct_status == 500
    assert "parse error" in direct["error"]["message"]
    if api == "messages":
        assert body["type"] == "error"
        assert body["error"]["type"] == "api_error"
        assert body["error"]["message"] == direct["error"]["message"]
    else:
        assert body == direct
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"]) == ("error", "upstream_5xx")


@pytest.mark.parametrize(("api", "body", "words"), [
    ("chat_completions", b'{"max_tokens": 3}', "'messages' is required"),
    ("chat_completions", b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}', "Field 'n'"),
    ("completions", b'{"max_tokens": 3}', "prompt"),
])  # fmt: skip
async def test_invalid_request_passes_as_llama_sent_it(
    make_proxy: ProxyFactory, llama: LlamaServer, api: str, body: bytes, words: str
) -> None:
    proxy = await make_proxy(upstream=llama.url)
    async with aiohttp.ClientSession() as http:
        direct_status, direct = await raw_post(http, llama.url + RAW_PATHS[api], body)
        status, through = await raw_post(http, proxy.url + RAW_PATHS[api], body)
    assert status == direct_status == 400
    assert through == direct
    assert through["error"]["type"] == "invalid_request_error"
    assert words in through["error"]["message"]


async def deferred(http: aiohttp.ClientSession, server: LlamaServer) -> float:
    async with http.get(server.url + "/metrics") as resp:
        return parse_metric(await resp.text(), "llamacpp:requests_deferred")


async def test_a_request_queued_behind_a_busy_slot_times_out_as_a_504(
    make_proxy: ProxyFactory, llama_wide: LlamaServer
) -> None:
    """`--parallel 1`: a second stream waits for the slot without any response headers; the proxy's
    --first-byte-timeout turns that into the dialect's 504 (which the SDKs may retry)."""
    proxy = await make_proxy(upstream=llama_wide.url, first_byte_timeout=0.3)
    async with aiohttp.ClientSession() as http:
        busy = {"model": MODEL, "stream": True, "max_tokens": 480, "temperature": 0,
                "messages": [{"role": "user", "content": PROMPT}]}  # fmt: skip
        holder = await http.post(llama_wide.url + "/v1/chat/completions", json=busy)
        try:
            await asyncio.wait_for(holder.content.readuntil(b"\n\n"), BOUND)
            queued = asyncio.ensure_future(ask(proxy.url, "chat_completions", stream=True))
            async with asyncio.timeout(BOUND):
                while await deferred(http, llama_wide) != 1 and not queued.done():  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            with pytest.raises(openai.InternalServerError) as info:
                await queued
            assert info.value.status_code == 504
            assert (info.value.type, info.value.code) == ("timeout_error", "first_byte_timeout")
        finally:
            holder.close()
        # llama-server keeps the abandoned request queued until the slot frees, then drops it.
        await predicted(http, llama_wide)
        assert await deferred(http, llama_wide) == 0
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"], line["upstream_cancelled"]) == ("error", "first_byte_timeout", True)


async def test_generation_that_fills_the_context_ends_as_length(make_proxy: ProxyFactory, llama: LlamaServer) -> None:
    """max_tokens beyond the context: llama-server stops at the context's end; the stream is complete."""
    proxy = await make_proxy(upstream=llama.url)
    through = await ask(proxy.url, "chat_completions", True, max_tokens=2000)
    finishes = [c["finish_reason"] for e in through for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"]) == ("ok", "complete")
    assert line["completion_tokens"] < 512




@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_batched_completions_are_not_taken_for_missing_choices(
    make_proxy: ProxyFactory, llama: LlamaServer, stream: bool
) -> None:
    """Two prompts: llama-server answers choices 0 and 1, which the proxy's batch check must accept."""
    proxy = await make_proxy(upstream=llama.url)
    body = {"model": MODEL, "prompt": ["One", "Two"], "max_tokens": 4, "temperature": 0, "stream": stream}
    async with aiohttp.ClientSession() as http:
        async with http.post(llama.url + "/v1/completions", json=body) as resp:
            direct = await resp.read()
        async with http.post(proxy.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            through = await resp.read()
    if stream:
        assert through.count(b'"finish_reason":"length"') == direct.count(b'"finish_reason":"length"') == 2
        assert through.endswith(b"data: [DONE]\n\n")
    else:
        assert sorted(c["index"] for c in orjson.loads(through)["choices"]) == [0, 1]
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"]) == ("ok", "complete")


# ---- a backend that dies or hangs mid-stream --------------------------------------------------------------


@pytest.fixture
def llama_victim(llama_binary: Path, models: dict[str, Path], tmp_path: Path) -> Iterator[LlamaServer]:
    """A server of its own, for a test that stops or kills it."""
    server = LlamaServer.start(llama_binary, models["wide"], tmp_path / "llama-victim.log", "--no-cache-prompt")
    try:
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.pid, signal.SIGCONT)
        server.stop()


async def read_some(stream: Any, count: int) -> list[Any]:
    seen = []
    async for item in stream:
        seen.append(item)
        if len(seen) == count:
            break
    return seen


@pytest.mark.parametrize("api", ["chat_completions", "messages"])
async def test_a_killed_server_ends_the_stream_with_the_dialects_error(
    make_proxy: ProxyFactory, llama_victim: LlamaServer, api: str
) -> None:
    proxy = await make_proxy(upstream=llama_victim.url)
    messages: Any = [{"role": "user", "content": PROMPT}]
    async with openai_client(proxy.url, BOUND) as oai, anthropic_client(proxy.url) as ant:
        stream: Any
        if api == "messages":
            stream = await ant.messages.create(model=MODEL, max_tokens=480, messages=messages, stream=True)
        else:
            stream = await oai.chat.completions.create(model=MODEL, max_tokens=480, messages=messages, stream=True)
        assert len(await read_some(stream, 5)) == 5
        os.kill(llama_victim.pid, signal.SIGKILL)
        with pytest.raises((openai.APIError, anthropic.APIStatusError)) as info:
            async with asyncio.timeout(BOUND):
                await read_some(stream, 10_000)
    exc = info.value
    if isinstance(exc, anthropic.APIStatusError):
        assert (exc.status_code, exc.type) == (200, "api_error")
    else:
        assert type(exc) is openai.APIError
        assert exc.code == "stream_cut"
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"]) == ("error", "stream_cut")


async def test_a_hung_server_is_a_stall_and_its_request_is_cancelled(
    make_proxy: ProxyFactory, llama_victim: LlamaServer
) -> None:
    """SIGSTOP mid-stream: after --idle-timeout the client gets the error frame and the proxy closes the
    upstream; once the server runs again it sees the close and stops generating."""
    # 5 s of silence: a stopped server is silent for ever, a running one on a busy machine is not for long.
    proxy = await make_proxy(upstream=llama_victim.url, idle_timeout=5.0)
    async with aiohttp.ClientSession() as http:
        before = await predicted(http, llama_victim)
        async with openai_client(proxy.url, BOUND) as oai:
            stream = await oai.chat.completions.create(
                model=MODEL, max_tokens=480, messages=[{"role": "user", "content": PROMPT}], stream=True
            )
            await read_some(stream, 5)
            os.kill(llama_victim.pid, signal.SIGSTOP)
            with pytest.raises(openai.APIError) as info:
                async with asyncio.timeout(BOUND):
                    await read_some(stream, 10_000)
        assert (info.value.code, info.value.type) == ("stall_timeout", "timeout_error")
        line = (await proxy.settled())[-1]
        assert (line["outcome"], line["reason"], line["upstream_cancelled"]) == ("error", "stall_timeout", True)
        os.kill(llama_victim.pid, signal.SIGCONT)
        assert await predicted(http, llama_victim) - before < 480  # stopped by the close, not run to its end
