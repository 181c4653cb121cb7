"""The official SDKs complete normal calls through the proxy, for each of their APIs."""

from __future__ import annotations

import anthropic
import openai
import pytest
from support import Proxy

MESSAGES = [{"role": "user", "content": "Say something."}]


def _openai(proxy: Proxy) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=20)


def _anthropic(proxy: Proxy) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=proxy.url, api_key="unused", max_retries=0, timeout=20)


async def test_openai_chat_stream_and_whole(proxy: Proxy) -> None:
    async with _openai(proxy) as client:
        stream = await client.chat.completions.create(
            model="m", messages=MESSAGES, stream=True, stream_options={"include_usage": True}  # type: ignore[arg-type]
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
        whole = await client.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
    assert text
    assert usage is not None
    assert usage.completion_tokens > 0
    assert whole.choices[0].message.content == text


async def test_openai_completions_stream_and_whole(proxy: Proxy) -> None:
    async with _openai(proxy) as client:
        stream = await client.completions.create(model="m", prompt="Once", stream=True)
        text = "".join([c.choices[0].text async for c in stream if c.choices])
        whole = await client.completions.create(model="m", prompt=["a", "b"], n=2)
    assert text
    assert sorted(choice.index for choice in whole.choices) == [0, 1, 2, 3]


async def test_openai_responses_stream_and_whole(proxy: Proxy) -> None:
    async with _openai(proxy) as client:
        async with client.responses.stream(model="m", input="hello") as stream:
            async for _ in stream:
                pass
            final = await stream.get_final_response()
        whole = await client.responses.create(model="m", input="hello")
    assert final.status == "completed"
    assert final.output_text
    assert whole.output_text == final.output_text


async def test_openai_embeddings_and_models(proxy: Proxy) -> None:
    async with _openai(proxy) as client:
        embeddings = await client.embeddings.create(model="m", input=["a", "b"])
        models = await client.models.list()
    assert len(embeddings.data) == 2
    assert [model.id async for model in models]


async def test_anthropic_messages_stream_and_whole(proxy: Proxy) -> None:
    async with _anthropic(proxy) as client:
        async with client.messages.stream(model="m", max_tokens=16, messages=MESSAGES) as stream:  # type: ignore[arg-type]
            async for _ in stream:
                pass
            final = await stream.get_final_message()
        whole = await client.messages.create(model="m", max_tokens=16, messages=MESSAGES)  # type: ignore[arg-type]
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.content
    assert whole.content
    assert whole.usage.output_tokens > 0


@pytest.mark.parametrize("hold", [0.0, 10.0])
async def test_openai_stream_with_and_without_late_commit(make_proxy, hold: float) -> None:  # type: ignore[no-untyped-def]
    proxy = await make_proxy(hold_headers=hold)
    async with _openai(proxy) as client:
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)  # type: ignore[arg-type]
        chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices[0].finish_reason == "stop"
