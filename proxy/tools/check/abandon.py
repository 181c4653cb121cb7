"""The probes that need the backend's own books: does closing a stream stop the generation, does a
conversation id keep it running for replay, and is a trailing assistant message continued.

Abandonment is measured from the backend's generated-token counter (``backends``): wait until it is
idle, note the counter, stream a long answer, close after a few content events, wait until it is idle
again, and compare what it generated with what had arrived. Without such a counter the answer is
``unknown``; the check never calls an abort or cancel API itself (it changes nothing on the backend),
so a generation that runs on is waited for (its length is bounded by the probe's ``max_tokens``).

The answer asked for is long (up to ABANDON_TOKENS, as the context allows): seconds of generation even
for a tiny model on a CPU, longer than a close takes to land even on a loaded machine, so the close,
not the answer's end, is what stops it, and stopped is told from went on by whether the answer ran to
its end (``verdicts.judge_abort``), not by how soon it stopped. Just before the close the check reads
the backend's gauge of running requests: at 0 the generation was over already (the backend generated
faster than a busy client read), and a full count afterwards says nothing about the close, so the
probe says ``unknown``, never ``quirk``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import orjson

from proxy.core.sse import Event, StatusBlock
from proxy.tools.check.backends import metric_sum
from proxy.tools.check.client import Stream, Unreachable
from proxy.tools.check.probes import Context
from proxy.tools.check.report import FAIL, OK, QUIRK, UNKNOWN, Finding
from proxy.tools.check.requests import DIALECTS, PROMPT, chat_body, content_of
from proxy.tools.check.verdicts import judge_abort, judge_prefill, message_of, prefill_cut

__all__ = ["abandon_tokens", "probe_conversation_replay", "probe_prefill", "probe_stops_generation"]

ABANDON_TOKENS = 4096  # the stream's max_tokens where the context allows: a run to its end is unmistakable
ABANDON_FALLBACK = 512  # ... where the backend announces no context length
CONTEXT_MARGIN = 128  # tokens of the context kept for the prompt and its template
RECEIVED = 8  # content events read before the close
SETTLE_TIMEOUT = 140.0  # seconds for the backend to be idle again (a run-on of ABANDON_TOKENS included)
POLL = 0.1
CONVERSATION_HEADER = "X-Conversation-Id"
_CHAT = DIALECTS["chat_completions"]
T = TypeVar("T")


class _NotMeasured(Exception):
    """The probe could not measure; the message says why (``unknown`` or ``fail``)."""

    def __init__(self, result: str, detail: str) -> None:
        super().__init__(detail)
        self.result, self.detail = result, detail


async def _metrics(ctx: Context) -> str:
    reply = await ctx.upstream.get("/metrics")
    if reply.status != 200:
        raise _NotMeasured(UNKNOWN, f"GET /metrics answered {reply.status} during the probe")
    return reply.body.decode("utf-8", "replace")


async def _idle_count(ctx: Context) -> float:
    """The generated-token counter once nothing runs and it stopped moving (bounded wait)."""
    backend = ctx.backend
    assert backend is not None
    deadline = time.monotonic() + SETTLE_TIMEOUT
    last: float | None = None
    while True:
        text = await _metrics(ctx)
        count = metric_sum(text, backend.generated)
        running = metric_sum(text, backend.running) or 0.0
        if count is None:
            raise _NotMeasured(UNKNOWN, f"{backend.generated} disappeared from /metrics")
        if running == 0 and count == last:
            return count
        last = count if running == 0 else None
        if time.monotonic() > deadline:
            busy = f"{backend.running} {running:g}"
            raise _NotMeasured(UNKNOWN, f"the backend was still busy ({busy}) after {SETTLE_TIMEOUT:g} s")
        await asyncio.sleep(POLL)


async def _chat_stream(
    ctx: Context,
    body: dict[str, Any],
    consume: Callable[[Stream, AsyncIterator[Event | StatusBlock]], Awaitable[T]],
    headers: dict[str, str] | None = None,
) -> T:
    """A streamed chat request with ``ignore_eos`` (so the answer runs to max_tokens), sent again
    without it when the backend rejects the field; ``consume`` reads it, and leaving closes it."""
    for attempt in ({**body, "ignore_eos": True}, body):
        async with ctx.upstream.stream(_CHAT, attempt, headers) as (stream, items):
            if stream.status == 400 and attempt is not body:
                continue
            return await consume(stream, items)
    raise AssertionError("unreachable")  # the second attempt always returns


def abandon_tokens(context_length: int | None) -> int:
    """The abandoned stream's max_tokens: ABANDON_TOKENS, less where the context is smaller."""
    if context_length is None:
        return ABANDON_FALLBACK
    return max(RECEIVED * 4, min(ABANDON_TOKENS, context_length - CONTEXT_MARGIN))


async def _running(ctx: Context) -> float:
    backend = ctx.backend
    assert backend is not None
    return metric_sum(await _metrics(ctx), backend.running) or 0.0


async def _abandon(ctx: Context, headers: dict[str, str] | None, max_tokens: int) -> tuple[int, float, bool]:
    """Stream, close after RECEIVED content events; (events received, tokens the backend generated,
    whether the generation was still running when the check closed)."""
    before = await _idle_count(ctx)
    running_at_close = False

    async def read_some(stream: Stream, items: AsyncIterator[Event | StatusBlock]) -> int:
        nonlocal running_at_close
        received = 0
        async for item in items:
            if stream.status != 200:
                continue
            if isinstance(item, Event) and item.has_data and content_of("chat_completions", _json(item)):
                received += 1
                if received >= RECEIVED:
                    running_at_close = await _running(ctx) > 0
                    break
        if stream.status != 200:
            raise _NotMeasured(FAIL, f"the stream was answered {stream.status}: {message_of(stream.body)}")
        return received

    received = await _chat_stream(ctx, chat_body(ctx.model, max_tokens, stream=True), read_some, headers)
    if received < RECEIVED:
        raise _NotMeasured(UNKNOWN, f"the stream ended after {received} content events, before the close")
    return received, await _idle_count(ctx) - before, running_at_close


def _json(event: Event) -> Any:
    try:
        return orjson.loads(event.data)
    except orjson.JSONDecodeError:
        return None


async def probe_stops_generation(ctx: Context) -> Finding:
    if ctx.backend is None:
        return Finding(
            "abort.stops_generation", UNKNOWN,
            "no generated-token counter in the backend's /metrics (llamacpp:, vllm:, sglang:) to measure with",
        )  # fmt: skip
    max_tokens = abandon_tokens(ctx.context_length)
    try:
        received, generated, running = await _abandon(ctx, None, max_tokens)
    except _NotMeasured as exc:
        return Finding("abort.stops_generation", exc.result, exc.detail)
    except Unreachable as exc:
        return Finding("abort.stops_generation", FAIL, f"no answer: {exc}")
    result, detail, went_on = judge_abort(received, generated, max_tokens, running_at_close=running)
    flags: tuple[str, ...] = ()
    if went_on:
        hook = ctx.backend.abort_hook
        flags = (f"--cancel-hook {hook}",) if hook else ()
        detail += (
            "; a --cancel-hook calling the backend's abort API is needed"
            if hook
            else ("; closing the connection does not stop this backend and it has no abort API the check knows")
        )
    return Finding("abort.stops_generation", result, f"{ctx.backend.generated}: {detail}", flags)


async def probe_conversation_replay(ctx: Context, plain: Finding | None) -> Finding:
    if ctx.backend is None:
        return Finding("abort.conversation_replay", UNKNOWN, "no generated-token counter to measure with")
    if plain is None or plain.result != OK:
        state = plain.result if plain is not None else "not run"
        return Finding(
            "abort.conversation_replay", UNKNOWN,
            f"not measured: a conversation id is told apart only where a plain close stops generation "
            f"(abort.stops_generation: {state})",
        )  # fmt: skip
    conversation = f"streamwarden-check-{uuid.uuid4().hex[:12]}"
    max_tokens = abandon_tokens(ctx.context_length)
    try:
        received, generated, running = await _abandon(ctx, {CONVERSATION_HEADER: conversation}, max_tokens)
    except _NotMeasured as exc:
        return Finding("abort.conversation_replay", exc.result, exc.detail)
    except Unreachable as exc:
        return Finding("abort.conversation_replay", FAIL, f"no answer: {exc}")
    what = f"the close with {CONVERSATION_HEADER}"
    result, detail, went_on = judge_abort(received, generated, max_tokens, what=what, running_at_close=running)
    if went_on:
        return Finding(
            "abort.conversation_replay", QUIRK,
            f"{detail}: the backend keeps the stream for replay (llama.cpp#23226); the hook ends it",
            ("--cancel-hook llama-conversation",),
        )  # fmt: skip
    if result == OK:
        return Finding("abort.conversation_replay", OK, f"no replay: {detail}")
    return Finding("abort.conversation_replay", result, detail)


async def _deltas(ctx: Context, body: dict[str, Any]) -> tuple[Stream, list[str]]:
    async def read_all(stream: Stream, items: AsyncIterator[Event | StatusBlock]) -> tuple[Stream, list[str]]:
        texts: list[str] = []
        async for item in items:
            if isinstance(item, Event) and item.has_data:
                text = content_of("chat_completions", _json(item))
                if text:
                    texts.append(text)
        return stream, texts

    return await _chat_stream(ctx, body, read_all)


async def probe_prefill(ctx: Context) -> Finding:
    """A greedy answer A; then A's first deltas as a trailing assistant message, once with the
    continuation fields vLLM, SGLang and llama-server take (`continue_final_message: true,
    add_generation_prompt: false`) and once plain (llama-server prefills by itself): is the rest of A
    what follows, and is the prefix echoed in front of it?"""
    if not ctx.served.get("chat_completions"):
        return Finding("resume.prefill", UNKNOWN, "chat completions are not served")
    forms = {
        "with continue_final_message": {"continue_final_message": True, "add_generation_prompt": False},
        "plain": {},
    }
    answers: dict[str, list[str]] = {}
    try:
        stream, fresh = await _deltas(ctx, chat_body(ctx.model, 32, stream=True))
        if stream.status != 200 or len(fresh) < 6:
            return Finding("resume.prefill", UNKNOWN, f"a greedy answer of {len(fresh)} content events is too short")
        found = prefill_cut(fresh)  # a point where a continuation and a restart differ
        unverifiable = None
        if found is None:  # an echo still shows: ask at the first deltas, judge the echo only
            unverifiable = (
                "starts with broken UTF-8 (U+FFFD), which cannot be sent back as the tokens that made it"
                if "\ufffd" in "".join(fresh[:3])
                else "repeats itself from its start: a continuation and a restart would look alike"
            )
        cut = 3 if found is None else found
        messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "".join(fresh[:cut])}]
        for form, fields in forms.items():
            body = chat_body(ctx.model, 16, stream=True, **fields)
            body["messages"] = messages
            stream, deltas = await _deltas(ctx, body)
            if stream.status == 200:
                answers[form] = deltas
            elif form == "plain":
                return Finding("resume.prefill", FAIL, f"a trailing assistant message was answered {stream.status}")
            # else the continuation fields are not understood: the plain form is judged alone
    except Unreachable as exc:
        return Finding("resume.prefill", FAIL, f"no answer: {exc}")
    result, detail = judge_prefill(fresh, answers, cut, unverifiable=unverifiable)
    return Finding("resume.prefill", result, detail)
