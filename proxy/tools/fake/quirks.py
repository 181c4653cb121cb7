"""Quirks: one backend behaviour shown on *every* request, the way a real backend has it, so that
`streamwarden check` (and an operator trying it) can meet each one: `fake-upstream --quirk NAME`.

A scenario (``x-fault``) breaks one request on demand; a quirk is what the backend always does. Some
quirks replay a scenario on every stream it applies to; the others change how the fake answers (its
routes, its error statuses, what it generates, what it does after the client left). Without a quirk
the fake behaves as a well-behaved backend: it stops generating when the client closes, answers a
malformed body or an over-long prompt with the dialect's 400, continues a trailing assistant message
without echoing it, and serves its own ``/metrics``:

    fake_upstream:generation_tokens_total   tokens generated (content events, per choice)
    fake_upstream:requests_running          generations in progress (a run-on included)
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from aiohttp import web

from proxy.tools.fake.generation import API_CHAT, GenSpec, token_text

__all__ = [
    "CONVERSATION_HEADER",
    "QUIRKS",
    "STATS",
    "FakeStats",
    "cancel_run_ons",
    "check_quirk",
    "continuation",
    "metrics_text",
    "quirk_fault",
    "run_on",
    "runs_on",
    "unserved",
]

CONVERSATION_HEADER = "X-Conversation-Id"

QUIRKS = MappingProxyType({
    "no_done": "every stream ends without its terminal ([DONE], response.completed, message_stop)",
    "stray_block": "every stream carries a raw HTTP/1.0 503 block after its preamble, then closes",
    "cut": "every stream is closed unterminated after its preamble and two content events",
    "abort_finish": 'every chat/completions choice ends with finish_reason "abort" (vLLM #57082)',
    "no_usage": "stream_options.include_usage is ignored",
    "malformed_500": "a body that is not JSON is answered 500, not 400 (llama-server)",
    "overflow_500": "a prompt longer than the context is answered 500, not 400",
    "runs_on": "a stream whose client left keeps generating to its end (Triton's OpenAI frontend)",
    "conversation_replay": "with X-Conversation-Id a stream whose client left keeps generating (llama.cpp#23226)",
    "prefill_echo": "a continued assistant message is echoed in front of the continuation (llama-server)",
    "no_prefill": "a trailing assistant message is not continued: a new answer starts",
    "no_metrics": "no /metrics endpoint",
    "health_lies": "/health and /v1/models answer 200 while every generation request gets 503",
    "chat_only": "only /v1/chat/completions is served: completions, responses and messages are 404",
})  # fmt: skip

#: quirks that are a fault scenario replayed on every stream it applies to
_AS_FAULT = {"no_done": "no_terminal", "stray_block": "stray_503", "cut": "cut", "abort_finish": "vllm_abort"}


def check_quirk(name: str | None) -> str | None:
    """``name`` if it is a quirk (``ValueError`` naming the known ones otherwise); ``None`` for none."""
    if not name:
        return None
    if name not in QUIRKS:
        raise ValueError(f"unknown quirk {name!r}; known quirks: {', '.join(QUIRKS)}")
    return name


def quirk_fault(quirk: str | None, stream: bool) -> str | None:
    """The scenario a quirk plays on a streamed generation request, if it is one of those."""
    if quirk is None or not stream:
        return None
    return _AS_FAULT.get(quirk)


def continuation(spec: GenSpec, body: object, quirk: str | None) -> GenSpec:
    """A chat request ending with an assistant message whose text is the start of the fake's answer is
    continued from there (as vLLM's ``continue_final_message`` and llama-server's prefill do)."""
    if spec.api != API_CHAT or quirk == "no_prefill" or not isinstance(body, dict):
        return spec
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages else None
    if not isinstance(last, dict) or last.get("role") != "assistant" or not isinstance(last.get("content"), str):
        return spec
    prefix, text, words = last["content"], "", 0
    while len(text) < len(prefix):
        text += token_text(words)
        words += 1
    if text != prefix:
        return spec  # not the start of this answer: a new one
    return spec.replace(start=words, echo=prefix if quirk == "prefill_echo" else "")


@dataclass
class FakeStats:
    """The fake's own books for ``/metrics``; background run-ons are kept referenced here."""

    generated: int = 0
    running: int = 0
    tokenized: int = 0  # /tokenize requests received
    tokenize_asked: asyncio.Event = field(default_factory=asyncio.Event)  # set at the first
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


STATS: web.AppKey[FakeStats] = web.AppKey("fake_stats", FakeStats)


def metrics_text(stats: FakeStats) -> str:
    return (
        "# HELP fake_upstream:generation_tokens_total Tokens generated (content events, per choice).\n"
        "# TYPE fake_upstream:generation_tokens_total counter\n"
        f"fake_upstream:generation_tokens_total {stats.generated}\n"
        "# HELP fake_upstream:requests_running Generations in progress.\n"
        "# TYPE fake_upstream:requests_running gauge\n"
        f"fake_upstream:requests_running {stats.running}\n"
    )


def runs_on(quirk: str | None, headers: Mapping[str, str]) -> bool:
    """Whether a stream whose client left keeps generating under this quirk."""
    return quirk == "runs_on" or (quirk == "conversation_replay" and bool(headers.get(CONVERSATION_HEADER)))


def run_on(stats: FakeStats, remaining: int, rate: float) -> None:
    """Go on "generating" ``remaining`` tokens at ``rate`` per second after the client left."""

    async def generate() -> None:
        stats.running += 1
        try:
            for _ in range(remaining):
                if rate > 0:
                    await asyncio.sleep(1.0 / rate)
                stats.generated += 1
        finally:
            stats.running -= 1

    task = asyncio.get_running_loop().create_task(generate())
    stats.tasks.add(task)
    task.add_done_callback(stats.tasks.discard)


async def cancel_run_ons(app: web.Application) -> None:
    """``on_cleanup``: a fake that stops leaves no task behind."""
    tasks = list(app[STATS].tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def unserved(quirk: str | None, api: str, generation_apis: frozenset[str]) -> tuple[int, str] | None:
    """The status and message a quirk answers a route with instead of serving it."""
    if quirk == "chat_only" and api in generation_apis and api != API_CHAT:
        return 404, "Not Found"
    if quirk == "health_lies" and api in generation_apis:
        return 503, "the engine is not running"
    return None


