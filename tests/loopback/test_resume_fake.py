"""Resume seen with the built-in fake alone: a fault with `once=1` breaks only a request's
first attempt, so `--resume-on-cut` in front of `fake-upstream` mends it, the recipe the README gives.

Without `once`, the continuation carries the same `x-fault` header and breaks again (the limit is
reached): what made a newcomer conclude resume was broken.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest
from support import FakeUpstream, ProxyFactory

pytestmark = pytest.mark.asyncio

PROMPT = [{"role": "user", "content": "Say something."}]
BREAKS = [
    ("cut;once=1", "stream_cut"),
    ("stall;once=1", "stall_timeout"),
    ("stray_503;after=3;once=1", "stray_http_block"),
]


async def chat(base: str, fault: str, request_id: str | None = None) -> list[dict[str, Any]]:
    headers = {"x-fault": fault} | ({"X-Request-Id": request_id} if request_id else {})
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        stream = await client.chat.completions.create(
            model="fake-model", messages=PROMPT, stream=True, max_tokens=8,
            stream_options={"include_usage": True}, extra_headers=headers,
        )  # fmt: skip
        return [chunk.model_dump() async for chunk in stream]


def text_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


@pytest.mark.parametrize(("fault", "reason"), BREAKS)
async def test_resume_on_cut_mends_a_fault_that_breaks_only_the_first_attempt(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, fault: str, reason: str
) -> None:
    proxy = await make_proxy(resume_on_cut=1, idle_timeout=1.0)
    whole = await chat(fake_upstream.url, "slow;rate=0")
    chunks = await chat(proxy.url, fault, "resume-fake-1")
    assert text_of(chunks) == text_of(whole)  # one whole stream: no repeated or missing text
    assert [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")] == chunks[:1]
    assert chunks[-1]["usage"]["completion_tokens"] == whole[-1]["usage"]["completion_tokens"]
    line = await proxy.line_for("resume-fake-1")
    assert (line["outcome"], line["reason"], line["resumes"]) == ("ok", "complete", 1)
    labels = {"api": "chat_completions", "reason": reason}
    assert proxy.sample("streamwarden_stream_resumes_total", labels | {"result": "resumed"}) == 1
    assert proxy.sample("streamwarden_stream_resumes_total", labels | {"result": "refused"}) == 0
    assert [r.scenario for r in fake_upstream.recorder.all() if r.request_id == "resume-fake-1"] == [
        fault.split(";")[0]
    ] * 2


async def test_without_once_the_continuation_breaks_again(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(resume_on_cut=1)
    with pytest.raises(openai.APIError) as raised:
        await chat(proxy.url, "cut", "resume-fake-2")
    assert raised.value.code == "stream_cut"
    line = await proxy.line_for("resume-fake-2")
    assert (line["outcome"], line["reason"]) == ("error", "stream_cut")


@pytest.mark.parametrize("key", ["X-Request-Id", "x-fault-key"])
async def test_once_breaks_the_first_attempt_of_a_key_and_serves_the_next_whole(
    fake_upstream: FakeUpstream, key: str
) -> None:
    """Directly against the fake: the same id breaks once; another id breaks again; no id always breaks."""
    url = fake_upstream.url + "/v1/chat/completions"
    body = {"model": "m", "stream": True, "messages": PROMPT, "max_tokens": 8}

    async def ends_with_done(headers: dict[str, str]) -> bool:
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json=body, headers={"x-fault": "cut;once=1", **headers}) as resp:
                try:
                    received = await resp.read()
                except aiohttp.ClientPayloadError:
                    return False
        return received.rstrip().endswith(b"data: [DONE]")

    assert not await ends_with_done({key: "a"})
    assert await ends_with_done({key: "a"})
    assert await ends_with_done({key: "a"})
    assert not await ends_with_done({key: "b"})
    assert not await ends_with_done({})
    assert not await ends_with_done({})


async def test_an_answer_past_the_body_limit_is_not_kept_and_its_cut_ends_as_without_the_flag(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream
) -> None:
    """No continuation can carry more than --max-body-size: a 100 MB answer was recorded whole for
    nothing (HWM 415-463 MiB against 45 without the flag). Past the limit nothing more is kept, and a
    later cut ends with its error frame, the log's `resume_refusal` saying why."""
    proxy = await make_proxy(resume_on_cut=1, max_body_size=1024)
    headers = {"x-fault": "cut;after=16;once=1;per=20", "X-Request-Id": "resume-fake-big"}  # 15 x 20 words
    async with openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        stream = await client.chat.completions.create(
            model="fake-model", messages=PROMPT, stream=True, max_tokens=600, extra_headers=headers,
        )  # fmt: skip
        received: list[dict[str, Any]] = []

        async def read() -> None:
            async for chunk in stream:
                received.append(chunk.model_dump())

        with pytest.raises(openai.APIError) as raised:
            await read()
    assert raised.value.code == "stream_cut"
    assert len(text_of(received)) > 1024  # (the answer so far passed the limit before the cut)
    line = await proxy.line_for("resume-fake-big")
    assert (line["outcome"], line["reason"], line["resumes"]) == ("error", "stream_cut", 0)
    assert "answer so far passed --max-body-size" in line["resume_refusal"]
    labels = {"api": "chat_completions", "reason": "stream_cut", "result": "refused"}
    assert proxy.sample("streamwarden_stream_resumes_total", labels) == 1
    assert len([r for r in fake_upstream.recorder.all() if r.request_id == "resume-fake-big"]) == 1
