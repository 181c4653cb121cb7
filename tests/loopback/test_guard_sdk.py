"""The stream guard end to end, seen by the official SDKs: every failing stream raises, nothing hangs.

openai chat and completions streams raise the base ``openai.APIError`` for an in-stream error frame and
an ``APIStatusError`` subclass for a failure before any content (late commit: a real HTTP status, which
the SDK would retry); the Responses stream yields ``response.failed`` and then raises on the ``error``
event; anthropic raises ``APIStatusError`` (status 200, the error's ``.type``) mid-stream and the status
class before it. Streams the proxy repairs (a missing terminal, a malformed event) complete normally.
Retries are off (``max_retries=0``) except in the one test that shows an SDK's retry succeeding.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

import anthropic
import openai
import pytest
from support import FakeUpstream, Proxy, ProxyFactory
from support.guard_cases import (
    ABORT_MESSAGE,
    ALL,
    ANTHROPIC_MESSAGES,
    ANTHROPIC_TYPE,
    CHAT_LIKE,
    CUT_MESSAGE,
    EARLY_DONE_MESSAGE,
    EVENT_LIMIT,
    FAKE_MESSAGE,
    MESSAGES,
    OPENAI_TYPE,
    OVERSIZED_MESSAGE,
    PREAMBLE,
    STALL_MESSAGE,
    STRAY_MESSAGE,
)

TEXT = "The fake upstream streams"  # the fake's first four words: max tokens 4
# Only a hang gets near it: an SDK retry waits out a Retry-After of 1 s and its own back-off, and a busy
# machine adds seconds to a test that takes 0.5 s alone.
BOUND = 30.0

OPENAI_STATUS_CLASS = {502: openai.InternalServerError, 503: openai.InternalServerError,
                       504: openai.InternalServerError}  # fmt: skip
ANTHROPIC_STATUS_CLASS: dict[int, type[anthropic.APIStatusError]] = {
    502: anthropic.InternalServerError, 503: anthropic.ServiceUnavailableError, 504: anthropic.GatewayTimeoutError,
}  # fmt: skip



@dataclass(frozen=True)
class Case:
    fault: str  # {pre}: the dialect's preamble length, {next}: one more
    dialects: tuple[str, ...]
    status: int
    message: str
    code: str  # as the SDK shows it (it makes a numeric code text)
    config: dict[str, Any] = field(default_factory=dict)

    def fault_for(self, dialect: str) -> str:
        return self.fault.format(pre=PREAMBLE[dialect], next=PREAMBLE[dialect] + 1)



IN_STREAM = {
    "stray_503": Case("stray_503;after={next}", ALL, 503, STRAY_MESSAGE, "503"),  # the upstream's code, as text
    "cut": Case("cut", ALL, 502, CUT_MESSAGE, "stream_cut"),
    "cut_eof": Case("cut;eof=1", ALL, 502, CUT_MESSAGE, "stream_cut"),
    "reset": Case("reset", ALL, 502, CUT_MESSAGE, "stream_cut"),
    "stall": Case("stall;hold=30", ALL, 504, STALL_MESSAGE, "stall_timeout", {"idle_timeout": 0.5}),
    "oversized_event": Case("oversized_event;size=65536", ALL, 502,
                            OVERSIZED_MESSAGE, "stream_cut",
                            {"max_event_size": EVENT_LIMIT}),
    "no_terminal": Case("no_terminal", ("responses",), 502, CUT_MESSAGE, "stream_cut"),
    "error_object_foreign": Case("error_object_foreign", CHAT_LIKE, 400, FAKE_MESSAGE, "400"),
    "error_string": Case("error_string", CHAT_LIKE, 502, FAKE_MESSAGE, "upstream_error_frame"),
    "error_field": Case("error_field", CHAT_LIKE, 500, FAKE_MESSAGE, "500"),
    "done_without_finish": Case("done_without_finish", CHAT_LIKE, 502, EARLY_DONE_MESSAGE, "stream_cut"),
    "vllm_abort": Case("vllm_abort", CHAT_LIKE, 502, ABORT_MESSAGE, "upstream_aborted"),
}  # fmt: skip

BEFORE_CONTENT = {
    "stray_503": Case("stray_503;after={pre}", ALL, 503, STRAY_MESSAGE, "503"),
    "cut": Case("cut;after={pre}", ALL, 502, CUT_MESSAGE, "stream_cut"),
    "reset": Case("reset;after={pre}", ALL, 502, CUT_MESSAGE, "stream_cut"),
    "stall": Case("stall;after={pre};hold=30", ALL, 504, STALL_MESSAGE, "stall_timeout", {"idle_timeout": 0.5}),
    "vllm_abort": Case("vllm_abort;at=0", CHAT_LIKE, 502, ABORT_MESSAGE, "upstream_aborted"),
}


def cases(table: dict[str, Case]) -> list[Any]:
    return [
        pytest.param(case, dialect, id=f"{name}-{dialect}") for name, case in table.items() for dialect in case.dialects
    ]  # fmt: skip


# ---- driving the SDKs ---------------------------------------------------------------------------------


def openai_client(proxy: Proxy, retries: int = 0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=retries, timeout=10)


def anthropic_client(proxy: Proxy, retries: int = 0) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=proxy.url, api_key="unused", max_retries=retries, timeout=10)


async def stream_openai(client: openai.AsyncOpenAI, dialect: str, headers: dict[str, str], seen: list[Any]) -> None:
    """Iterate one openai stream to its end, appending every chunk or event to ``seen``."""
    stream: Any
    if dialect == "chat_completions":
        stream = await client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=4, stream=True, extra_headers=headers
        )
    elif dialect == "completions":
        stream = await client.completions.create(model="m", prompt="hi", max_tokens=4, stream=True,
                                                 extra_headers=headers)  # fmt: skip
    else:
        stream = await client.responses.create(model="m", input="hi", max_output_tokens=4, stream=True,
                                               extra_headers=headers)  # fmt: skip
    async for item in stream:
        seen.append(item)


async def stream_anthropic(client: anthropic.AsyncAnthropic, headers: dict[str, str], seen: list[Any]) -> None:
    stream = await client.messages.create(
        model="m", max_tokens=4, messages=ANTHROPIC_MESSAGES, stream=True, extra_headers=headers
    )
    async for event in stream:
        seen.append(event)


async def run_stream(proxy: Proxy, dialect: str, fault: str, seen: list[Any]) -> None:
    headers = {"x-fault": fault}
    async with asyncio.timeout(BOUND):
        if dialect == "messages":
            async with anthropic_client(proxy) as ant:
                await stream_anthropic(ant, headers, seen)
        else:
            async with openai_client(proxy) as oai:
                await stream_openai(oai, dialect, headers, seen)


def text_of(dialect: str, seen: list[Any]) -> str:
    """The generated text the SDK handed out."""
    if dialect == "chat_completions":
        return "".join(c.choices[0].delta.content or "" for c in seen if c.choices)
    if dialect == "completions":
        return "".join(c.choices[0].text for c in seen if c.choices)
    if dialect == "responses":
        return "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    return "".join(e.delta.text for e in seen if e.type == "content_block_delta")


def check_in_stream_error(dialect: str, exc: BaseException, seen: list[Any], status: int, message: str,
                          code: str) -> None:  # fmt: skip
    """The SDK's exception for an error frame inside a 200 stream."""
    if dialect == "messages":
        assert type(exc) is anthropic.APIStatusError
        assert exc.status_code == 200
        assert (exc.type, exc.api_message) == (ANTHROPIC_TYPE[status], message)
        assert not any(e.type == "message_stop" for e in seen)
        return
    assert type(exc) is openai.APIError  # raised from the iterator: never retried, no status
    assert (exc.message, exc.type, exc.code) == (message, OPENAI_TYPE[status], code)
    if dialect == "responses":
        assert seen[-1].type == "response.failed"  # consumers keyed on the response see the failure too
        assert seen[-1].response.status == "failed"
        assert seen[-1].response.error.message == message


# ---- in-stream failures -------------------------------------------------------------------------------


@pytest.mark.parametrize(("case", "dialect"), cases(IN_STREAM))
async def test_error_frame_raises(make_proxy: ProxyFactory, case: Case, dialect: str) -> None:
    proxy = await make_proxy(**case.config)
    seen: list[Any] = []
    with pytest.raises((openai.APIError, anthropic.APIError)) as info:
        await run_stream(proxy, dialect, case.fault_for(dialect), seen)
    check_in_stream_error(dialect, info.value, seen, case.status, case.message, case.code)
    assert text_of(dialect, seen)  # content before the failure was delivered


@pytest.mark.parametrize(("case", "dialect"), cases(BEFORE_CONTENT))
async def test_error_frame_raises_without_hold(make_proxy: ProxyFactory, case: Case, dialect: str) -> None:
    """hold_headers=0: a failure before content is an in-stream error too (the SDK cannot retry it)."""
    proxy = await make_proxy(hold_headers=0, **case.config)
    seen: list[Any] = []
    with pytest.raises((openai.APIError, anthropic.APIError)) as info:
        await run_stream(proxy, dialect, case.fault_for(dialect), seen)
    check_in_stream_error(dialect, info.value, seen, case.status, case.message, case.code)
    assert not text_of(dialect, seen)


@pytest.mark.parametrize("dialect", ALL)
async def test_upstream_error_frame_raises(proxy: Proxy, dialect: str) -> None:
    """`error_after_first`: the upstream's own error frame passes as is, and the SDK raises on it at once
    even though the upstream keeps its connection open for 600 s."""
    seen: list[Any] = []
    with pytest.raises((openai.APIError, anthropic.APIError)) as info:
        await run_stream(proxy, dialect, "error_after_first", seen)
    exc = info.value
    assert text_of(dialect, seen) == "The"
    if dialect == "messages":
        assert type(exc) is anthropic.APIStatusError
        assert (exc.status_code, exc.type, exc.api_message) == (200, "api_error", FAKE_MESSAGE)
    else:
        assert type(exc) is openai.APIError
        assert exc.message == FAKE_MESSAGE
        # vLLM's shape (an integer code, its exception name as type) is passed unchanged in its own dialect.
        expected = ("server_error", "server_error") if dialect == "responses" else ("InternalServerError", "500")
        assert (exc.type, exc.code) == expected


# ---- failures before content: a real status -----------------------------------------------------------


@pytest.mark.parametrize(("case", "dialect"), cases(BEFORE_CONTENT))
async def test_late_commit_raises_the_status_class(make_proxy: ProxyFactory, case: Case, dialect: str) -> None:
    proxy = await make_proxy(**case.config)
    seen: list[Any] = []
    with pytest.raises((openai.APIStatusError, anthropic.APIStatusError)) as info:
        await run_stream(proxy, dialect, case.fault_for(dialect), seen)
    exc = info.value
    assert isinstance(exc, (openai.APIStatusError, anthropic.APIStatusError))
    assert not seen  # raised by create(), before any iteration
    assert exc.status_code == case.status
    retry_after = "1" if case.fault.startswith("stray_503") else None
    assert exc.response.headers.get("retry-after") == retry_after
    if isinstance(exc, anthropic.APIStatusError):
        assert type(exc) is ANTHROPIC_STATUS_CLASS[case.status]
        assert (exc.type, exc.api_message) == (ANTHROPIC_TYPE[case.status], case.message)
    else:
        assert type(exc) is OPENAI_STATUS_CLASS[case.status]
        assert (exc.type, exc.code) == (OPENAI_TYPE[case.status], case.code)
        assert case.message in exc.message


# ---- streams the proxy repairs ------------------------------------------------------------------------


@pytest.mark.parametrize(("fault", "dialect"), [
    *[("no_terminal", d) for d in ("chat_completions", "completions", "messages")],
    *[("malformed_event", d) for d in ALL],
])  # fmt: skip
async def test_repaired_stream_completes(proxy: Proxy, fault: str, dialect: str) -> None:
    seen: list[Any] = []
    await run_stream(proxy, dialect, fault, seen)
    assert text_of(dialect, seen) == TEXT
    if dialect == "messages":
        assert seen[-1].type == "message_stop"
    elif dialect == "responses":
        assert seen[-1].type == "response.completed"
    else:
        assert [c.choices[0].finish_reason for c in seen if c.choices][-1] == "length"


# ---- the SDK's own retries ----------------------------------------------------------------------------


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
@pytest.mark.parametrize("mode", ["status", "stream"])
async def test_sdk_retry_succeeds_after_late_commit(
    proxy: Proxy, fake_upstream: FakeUpstream, sdk: str, mode: str
) -> None:
    """`fail_first`: the first attempt fails before any content (a 503 from the upstream, or a stray 503
    block inside its 200 stream that the proxy turns into a real 503), the SDK retries, the second succeeds."""
    key = uuid.uuid4().hex
    headers = {"x-fault": f"fail_first;mode={mode}", "x-fault-key": key}
    seen: list[Any] = []
    async with asyncio.timeout(BOUND):
        if sdk == "openai":
            async with openai_client(proxy, retries=2) as oai:
                await stream_openai(oai, "chat_completions", headers, seen)
        else:
            async with anthropic_client(proxy, retries=2) as ant:
                await stream_anthropic(ant, headers, seen)
    assert text_of("chat_completions" if sdk == "openai" else "messages", seen) == TEXT
    attempts = [r for r in fake_upstream.recorder.all() if r.headers.get("x-fault-key") == key]
    assert len(attempts) == 2
    async with asyncio.timeout(BOUND):  # the last line is written as the handler unwinds
        while len(proxy.log_lines()) < 2:  # noqa: ASYNC110 (a log line has no event to wait on)
            await asyncio.sleep(0.01)
    lines = proxy.log_lines()
    first = "upstream_5xx" if mode == "status" else "stray_http_block"
    assert [(line["outcome"], line["reason"], line["status"]) for line in lines] == [
        ("error", first, 503), ("ok", "complete", 200)]  # fmt: skip
