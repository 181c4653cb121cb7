"""--resume-on-cut against llama-server: a relay breaks the first answer after a few tokens (a cut, a
stall, a stray `HTTP/1.0 503` block), and the client's answer through the proxy is the answer
llama-server gives the same request uncut, text and usage alike.

The model only ever says single characters (tests/real/llama.py, `CHARS`), so the text of any answer
tokenizes back into the tokens that wrote it, and greedy decoding makes the continuation of a text
the same as the rest of the uncut answer: what is compared here is the proxy's part (what it sends,
what it strips and stitches, what it counts), token for token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import openai
import orjson
import pytest
from llama import LlamaServer
from support import Proxy, ProxyFactory
from support.cut_relay import BREAKS, CutRelay, Gate, read_gated

pytestmark = pytest.mark.real

MAX_TOKENS = 48
AFTER = 8  # tokens relayed before the break
BOUND = 30.0
APIS = ["chat_completions", "completions"]


@dataclass
class Answer:
    text: str
    usage: dict[str, Any]
    chunks: list[dict[str, Any]]

    @property
    def ids(self) -> set[str]:
        return {c["id"] for c in self.chunks}

    @property
    def roles(self) -> int:
        return sum(1 for c in self.chunks for ch in c["choices"] if (ch.get("delta") or {}).get("role"))

    @property
    def finish_reasons(self) -> list[str]:
        return [ch["finish_reason"] for c in self.chunks for ch in c["choices"] if ch.get("finish_reason")]


async def ask(base: str, api: str, gate: Gate | None = None, prompt: str = "Say something.") -> Answer:
    """One greedy streamed answer through the openai SDK, with usage; each content event it receives
    opens the relay's `gate` a step."""
    common: dict[str, Any] = {
        "model": "chars", "stream": True, "temperature": 0, "seed": 42, "max_tokens": MAX_TOKENS,
        "stream_options": {"include_usage": True},
    }
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=BOUND) as client:
        if api == "chat_completions":
            stream: Any = await client.chat.completions.create(
                messages=[{"role": "user", "content": prompt}], **common
            )
        else:
            stream = await client.completions.create(prompt=prompt, **common)
        chunks = await read_gated(stream, gate)
    key = "content" if api == "chat_completions" else "text"
    text = "".join((ch.get("delta") or ch).get(key) or "" for c in chunks for ch in c["choices"])
    usage = chunks[-1]["usage"]
    assert usage is not None, chunks[-1]
    return Answer(text, {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}, chunks)


async def through(make_proxy: ProxyFactory, llama: LlamaServer, relays: list[CutRelay], plan: list[str | None],
                  **flags: Any) -> tuple[Proxy, CutRelay]:  # fmt: skip
    relay = await CutRelay(llama.url, plan, after=AFTER, gate=Gate(AFTER)).start()
    relays.append(relay)
    return await make_proxy(upstream=relay.url, idle_timeout=2.0, **flags), relay


@pytest.mark.parametrize("how", BREAKS)
@pytest.mark.parametrize("api", APIS)
async def test_a_cut_answer_resumed_is_the_uncut_answer(
    make_proxy: ProxyFactory, llama_chars: LlamaServer, relays: list[CutRelay], api: str, how: str
) -> None:
    direct = await ask(llama_chars.url, api)
    assert direct.usage["completion_tokens"] == MAX_TOKENS  # the model never picks EOS
    assert len(set(direct.text)) > 3, direct.text  # varied enough that a shifted seam would show
    proxy, relay = await through(make_proxy, llama_chars, relays, [how], resume_on_cut=1)
    answer = await ask(proxy.url, api, relay.gate)
    assert relay.broken == 1
    assert len(relay.bodies) == 2
    print(f"\n{api} {how}, cut after {AFTER} tokens: direct {direct.text!r}, through {answer.text!r}")
    assert answer.text == direct.text
    assert answer.usage == direct.usage
    assert len(answer.ids) == 1
    assert answer.finish_reasons == ["length"]
    if api == "chat_completions":
        assert answer.roles == 1
        continuation = orjson.loads(relay.bodies[1])
        assert continuation["messages"][-1] == {"role": "assistant", "content": direct.text[:AFTER]}
        assert continuation["max_tokens"] == MAX_TOKENS - AFTER
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"], line["resumes"]) == ("ok", "complete", 1)
    assert (line["prompt_tokens"], line["completion_tokens"]) == (direct.usage["prompt_tokens"], MAX_TOKENS)
    reason = {"close": "stream_cut", "stall": "stall_timeout", "stray": "stray_http_block"}[how]
    labels = {"api": api, "reason": reason, "result": "resumed"}
    assert proxy.sample("streamwarden_stream_resumes_total", labels) == 1


@pytest.mark.parametrize("api", APIS)
async def test_a_relay_that_breaks_every_attempt_ends_at_the_limit(
    make_proxy: ProxyFactory, llama_chars: LlamaServer, relays: list[CutRelay], api: str
) -> None:
    direct = await ask(llama_chars.url, api)
    proxy, relay = await through(make_proxy, llama_chars, relays, ["close"] * 5, resume_on_cut=2)
    with pytest.raises(openai.APIError) as raised:
        await ask(proxy.url, api, relay.gate)
    assert raised.value.code == "stream_cut"
    assert (relay.broken, len(relay.bodies)) == (3, 3)
    continuations = [orjson.loads(body) for body in relay.bodies[1:]]
    if api == "chat_completions":
        assert [c["messages"][-1]["content"] for c in continuations] == [direct.text[:AFTER], direct.text[:2 * AFTER]]
    else:
        assert [c["prompt"] for c in continuations] == [
            "Say something." + direct.text[:AFTER], "Say something." + direct.text[:2 * AFTER]]
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"], line["resumes"]) == ("error", "stream_cut", 2)


async def test_flag_off_the_cut_reaches_the_client_as_today(
    make_proxy: ProxyFactory, llama_chars: LlamaServer, relays: list[CutRelay]
) -> None:
    proxy, relay = await through(make_proxy, llama_chars, relays, ["close"])
    with pytest.raises(openai.APIError) as raised:
        await ask(proxy.url, "chat_completions", relay.gate)
    assert raised.value.code == "stream_cut"
    assert len(relay.bodies) == 1
    line = (await proxy.settled())[-1]
    assert (line["outcome"], line["reason"]) == ("error", "stream_cut")
    assert "resumes" not in line
