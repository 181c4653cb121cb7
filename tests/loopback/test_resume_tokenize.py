"""A continuation's budget where the stream does not say how many tokens it carried: a backend that
sends several tokens per chunk (speculative decoding, vLLM's `--stream-interval`) and neither token
ids nor per-chunk usage. The proxy asks the backend's `/tokenize` for the count of the text so far;
without an answer it can trust, it refuses to continue rather than ask for more than the budget left.

The fake upstream sends `per=3` words (its tokens) in each chunk, and serves `/tokenize` (one token
per word) unless told not to (`tokenize=False`, `fake-upstream --no-tokenize`); `tokenize=MODE`
makes that endpoint hostile.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp.pytest_plugin import AiohttpServer
from support import FakeUpstream, Proxy, ProxyFactory
from support.cut_relay import CutRelay

from proxy.tools.fake import RECORDER, STATS, FakeSettings, build_app

pytestmark = pytest.mark.asyncio

PROMPT = [{"role": "user", "content": "Say something."}]
BUDGET = 30
PER = 3
AFTER = 5  # frames before the fake cuts: the role chunk and 4 chunks of 3 words, 12 tokens
CUT = "cut;after=5;once=1;per=3"


@pytest.fixture
async def relay(fake_upstream: FakeUpstream) -> AsyncIterator[CutRelay]:
    """Passes everything whole, and keeps the bodies the proxy sends (the continuation's, /tokenize's)."""
    relay = await CutRelay(fake_upstream.url, []).start()
    yield relay
    await relay.stop()


async def chat(base: str, fault: str, request_id: str, **extra: Any) -> list[dict[str, Any]]:
    headers = {"x-fault": fault, "X-Request-Id": request_id}
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        fields: dict[str, Any] = {"max_tokens": BUDGET, "stream_options": {"include_usage": True}, **extra}
        stream = await client.chat.completions.create(
            model="fake-model", messages=PROMPT, stream=True, extra_headers=headers, **fields
        )
        return [chunk.model_dump() async for chunk in stream]


def text_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def resumes(proxy: Proxy, result: str) -> float:
    labels = {"api": "chat_completions", "reason": "stream_cut", "result": result}
    return proxy.sample("streamwarden_stream_resumes_total", labels)


async def test_the_continuation_asks_the_budget_left_in_tokens_not_chunks(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, relay: CutRelay
) -> None:
    """4 chunks of 3 tokens were cut: the continuation asks 30 - 12 = 18 (counting chunks it asked 26,
    and the client got 38 tokens for a budget of 30)."""
    proxy = await make_proxy(upstream=relay.url, resume_on_cut=1)
    whole = await chat(fake_upstream.url, f"late_headers;delay=0;per={PER}", "tok-direct")
    chunks = await chat(proxy.url, CUT, "tok-1")
    continuation = orjson.loads(relay.bodies[1])
    so_far = continuation["messages"][-1]["content"]
    assert len(so_far.split()) == (AFTER - 1) * PER
    assert continuation["max_tokens"] == BUDGET - (AFTER - 1) * PER
    assert [orjson.loads(body)["prompt"] for body in relay.tokenized] == [so_far]
    assert orjson.loads(relay.tokenized[0])["add_special_tokens"] is False
    assert text_of(chunks) == text_of(whole)  # the uncut answer: 30 tokens, none more
    assert len(text_of(chunks).split()) == BUDGET
    assert chunks[-1]["usage"] == whole[-1]["usage"]
    line = await proxy.line_for("tok-1")
    assert (line["outcome"], line["reason"], line["resumes"], line["completion_tokens"]) == (
        "ok", "complete", 1, BUDGET
    )
    assert resumes(proxy, "resumed") == 1


async def test_a_backend_without_a_tokenizer_is_not_continued(
    make_proxy: ProxyFactory, aiohttp_server: AiohttpServer
) -> None:
    """No `/tokenize` (404): the count by chunks is only a lower bound, so no continuation is sent."""
    app = build_app(FakeSettings(tokenize=False))
    server = await aiohttp_server(app)
    proxy = await make_proxy(upstream=str(server.make_url("")).rstrip("/"), resume_on_cut=1)
    with pytest.raises(openai.APIError) as raised:
        await chat(proxy.url, CUT, "tok-2")
    assert raised.value.code == "stream_cut"
    line = await proxy.line_for("tok-2")
    assert (line["outcome"], line["reason"], line["resumes"]) == ("error", "stream_cut", 0)
    assert "no tokenizer" in line["resume_refusal"]
    assert "status 404" in line["resume_refusal"]
    assert (resumes(proxy, "refused"), resumes(proxy, "resumed"), resumes(proxy, "failed")) == (1, 0, 0)
    assert len([r for r in app[RECORDER].all() if r.request_id == "tok-2"]) == 1


@pytest.mark.parametrize("tokenizer", ["none", "junk"])
async def test_without_a_count_a_stream_without_a_budget_is_continued_its_usage_estimated(
    make_proxy: ProxyFactory, aiohttp_server: AiohttpServer, tokenizer: str
) -> None:
    """No budget to protect: a backend without `/tokenize` (404), or one whose answer is no count, does not
    stop the continuation (before: refused, "no tokenizer to count the answer so far"). The continuation
    asks no budget either; the usage chunk the client asked for is the chunks' lower bound, booked and
    logged `estimated`."""
    app = build_app(FakeSettings(tokenize=tokenizer != "none"))
    server = await aiohttp_server(app)
    relay = await CutRelay(str(server.make_url("")).rstrip("/"), []).start()
    try:
        proxy = await make_proxy(upstream=relay.url, resume_on_cut=1)
        fault = CUT + ("" if tokenizer == "none" else f";tokenize={tokenizer}")
        chunks = await chat(proxy.url, fault, "tok-6", max_tokens=None)
    finally:
        await relay.stop()
    assert len(relay.tokenized) == 1  # asked (for the usage), and not answered with a count
    continuation = orjson.loads(relay.bodies[1])
    so_far = continuation["messages"][-1]["content"]
    assert len(so_far.split()) == (AFTER - 1) * PER
    assert continuation.get("max_tokens") is None  # (the SDK sends the client's null as it is)
    assert continuation.get("max_completion_tokens") is None
    assert text_of(chunks).startswith(so_far)
    usage = chunks[-1]["usage"]
    # The continuation's own tokens, and the answer so far counted by its 4 chunks, not its 12 tokens.
    assert usage["completion_tokens"] == len(text_of(chunks).split()) - (AFTER - 1) * PER + (AFTER - 1)
    line = await proxy.line_for("tok-6")
    assert (line["outcome"], line["reason"], line["resumes"]) == ("ok", "complete", 1)
    assert "resume_refusal" not in line
    assert line["usage_source"] == "estimated"
    assert (resumes(proxy, "resumed"), resumes(proxy, "refused")) == (1, 0)
    labels = {"api": "chat_completions", "model": "fake-model", "kind": "completion", "source": "estimated"}
    assert proxy.sample("streamwarden_tokens_total", labels) == usage["completion_tokens"]


async def test_a_counted_resume_books_its_usage_as_the_upstream_s(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream
) -> None:
    """The same stream where `/tokenize` counts: the usage is the uncut answer's, booked `usage`."""
    proxy = await make_proxy(resume_on_cut=1)
    await chat(proxy.url, CUT, "tok-7", max_tokens=None)
    line = await proxy.line_for("tok-7")
    assert (line["outcome"], line["resumes"], line["usage_source"]) == ("ok", 1, "usage")
    assert fake_upstream.server.app[STATS].tokenized == 1


@pytest.mark.parametrize(
    ("mode", "why"),
    [
        ("huge", "/tokenize answered more than"),
        ("negative", "count -5 is not a count"),
        ("junk", "/tokenize answered no JSON"),
        ("slow", "/tokenize did not answer within 2 s"),
    ],
)
async def test_a_hostile_tokenizer_refuses_the_continuation(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, mode: str, why: str
) -> None:
    """A 16 MiB body is not read past its small limit, a slow one is not waited for past
    --first-byte-timeout, a negative count or HTML is no count: each break is refused, and booked so."""
    proxy = await make_proxy(resume_on_cut=1, first_byte_timeout=2.0)
    with pytest.raises(openai.APIError) as raised:
        await chat(proxy.url, CUT + f";tokenize={mode}", "tok-3")
    assert raised.value.code == "stream_cut"
    line = await proxy.line_for("tok-3")
    assert (line["outcome"], line["reason"], line["resumes"]) == ("error", "stream_cut", 0)
    assert why in line["resume_refusal"]
    assert (resumes(proxy, "refused"), resumes(proxy, "resumed")) == (1, 0)
    assert fake_upstream.server.app[STATS].tokenized == 1


async def test_no_tokenizer_is_asked_when_no_count_matters(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream
) -> None:
    """No budget and no usage asked for: the count changes nothing the continuation or the client sees."""
    proxy = await make_proxy(resume_on_cut=1)
    unbounded: dict[str, Any] = {"max_tokens": None, "stream_options": None}
    whole = await chat(fake_upstream.url, f"late_headers;delay=0;per={PER}", "tok-direct", **unbounded)
    chunks = await chat(proxy.url, CUT, "tok-4", **unbounded)
    assert text_of(chunks).startswith(text_of(whole))  # (the fake's continuation has a length of its own)
    assert fake_upstream.server.app[STATS].tokenized == 0
    assert resumes(proxy, "resumed") == 1


async def test_shutdown_ends_the_wait_for_the_tokenizer(make_proxy: ProxyFactory, fake_upstream: FakeUpstream) -> None:
    """A `/tokenize` that never answers holds the continuation up to --first-byte-timeout (60 s here):
    shutdown ends that wait at once, with the stream's shutdown frame."""
    proxy = await make_proxy(resume_on_cut=1, first_byte_timeout=60.0, drain_timeout=0.2)
    stats = fake_upstream.server.app[STATS]
    body = {"model": "fake-model", "stream": True, "messages": PROMPT, "max_tokens": BUDGET}
    headers = {"x-fault": CUT + ";tokenize=slow", "X-Request-Id": "tok-5"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as resp,
    ):
        received = b""
        async with asyncio.timeout(10):
            await stats.tokenize_asked.wait()  # (then the proxy waits for /tokenize, which never answers)
            proxy.server.request_stop()
            shutting = asyncio.create_task(proxy.server.shutdown())
            received += await resp.content.read()
            await shutting
    assert b'"code":"shutdown"' in received
    line = await proxy.line_for("tok-5")
    assert (line["outcome"], line["reason"]) == ("error", "shutdown")
