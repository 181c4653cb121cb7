"""What the real SDKs make of the guard's output: normal streams iterate cleanly, every error raises.

No sockets: the guard's bytes are served by an httpx2 MockTransport to the openai and anthropic clients.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import anthropic
import httpx2
import openai
import orjson
import pytest

from proxy.core.dialects import DIALECTS
from proxy.core.guard import StreamGuard
from proxy.core.verdicts import Reason


def data(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def named(obj: dict[str, object]) -> bytes:
    return b"event: " + str(obj["type"]).encode() + b"\n" + data(obj)


def chat(content: str | None = None, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": content}, "finish_reason": finish}
    return data({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]})


def text(content: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": content, "finish_reason": finish}
    return data({"id": "c", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]})


DONE = b"data: [DONE]\n\n"
CHAT_PARTIAL = chat("Hel") + b": keep-alive\n\n" + chat("lo")
CHAT_BODY = CHAT_PARTIAL + chat(None, "stop")
CHAT_USAGE = data({"id": "c", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}})
COMPLETIONS_BODY = text("Hel") + text("lo", "length")

RESPONSE = {"id": "resp_1", "object": "response", "created_at": 5, "model": "m", "status": "in_progress", "output": []}
RESPONSES_BODY = named({"type": "response.created", "sequence_number": 0, "response": RESPONSE}) + named(
    {
        "type": "response.output_text.delta",
        "sequence_number": 1,
        "delta": "Hel",
        "item_id": "i",
        "output_index": 0,
        "content_index": 0,
    }
)
RESPONSES_END = named(
    {"type": "response.completed", "sequence_number": 2, "response": {**RESPONSE, "status": "completed"}}
)

MESSAGES_BODY = named(
    {
        "type": "message_start",
        "message": {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": "m",
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 25, "output_tokens": 1},
        },
    }
) + named({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}})
MESSAGES_STOP_DELTA = named(
    {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"output_tokens": 2},
    }
)
MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'

STRAY_BODY = b'{"error":{"message":"engine busy","code":503}}'
STRAY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n%s" % (len(STRAY_BODY), STRAY_BODY)
BARE_ERROR = b'error: {"code": 503, "message": "bad things"}\n\n'


def guarded(name: str, upstream: bytes, end: str | None = "eof") -> bytes:
    """The bytes the client receives (the stream must have been committed)."""
    guard = StreamGuard(DIALECTS[name], hold=True)
    steps = [guard.feed(upstream)]
    if end == "eof":
        steps.append(guard.end_of_stream())
    elif end is not None:
        steps.append(guard.fail(Reason(end)))
    assert guard.released
    return b"".join(step.data for step in steps)


def _transport(body: bytes) -> httpx2.MockTransport:
    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    return httpx2.MockTransport(handler)


@contextmanager
def openai_client(body: bytes) -> Iterator[openai.OpenAI]:
    http = httpx2.Client(transport=_transport(body))
    with openai.OpenAI(api_key="k", base_url="http://upstream/v1", http_client=http, max_retries=0) as client:
        yield client


@contextmanager
def anthropic_client(body: bytes) -> Iterator[anthropic.Anthropic]:
    http = httpx2.Client(transport=_transport(body))
    with anthropic.Anthropic(api_key="k", base_url="http://upstream", http_client=http, max_retries=0) as client:
        yield client


def chat_text(body: bytes) -> str:
    with openai_client(body) as client:
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def completion_text(body: bytes) -> str:
    with openai_client(body) as client:
        stream = client.completions.create(model="m", prompt="hi", stream=True)
        return "".join(c.choices[0].text for c in stream if c.choices)


def responses_types(body: bytes) -> list[str]:
    with openai_client(body) as client:
        return [event.type for event in client.responses.create(model="m", input="hi", stream=True)]


def messages_types(body: bytes) -> list[str]:
    with anthropic_client(body) as client:
        stream = client.messages.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        return [event.type for event in stream]


# ---- normal streams -----------------------------------------------------------------------------------


def test_chat_stream_iterates_cleanly() -> None:
    assert chat_text(guarded("chat_completions", CHAT_BODY + CHAT_USAGE + DONE)) == "Hello"


def test_chat_missing_done_is_added() -> None:
    out = guarded("chat_completions", CHAT_BODY)
    assert out.endswith(DONE)
    assert chat_text(out) == "Hello"


def test_chat_malformed_event_dropped_so_the_sdk_survives() -> None:
    assert chat_text(guarded("chat_completions", CHAT_BODY + b"data: {oops\n\n" + DONE)) == "Hello"


def test_completions_stream_iterates_cleanly() -> None:
    assert completion_text(guarded("completions", COMPLETIONS_BODY)) == "Hello"


def test_responses_stream_iterates_cleanly() -> None:
    types = responses_types(guarded("responses", RESPONSES_BODY + RESPONSES_END))
    assert types[0] == "response.created"
    assert types[-1] == "response.completed"


def test_messages_stream_iterates_cleanly() -> None:
    types = messages_types(guarded("messages", MESSAGES_BODY + MESSAGES_STOP_DELTA))
    assert types[0] == "message_start"
    assert types[-1] == "message_stop"


# ---- failures raise ----------------------------------------------------------------------------------

OPENAI_FAILURES = {
    "cut": (CHAT_PARTIAL, "eof", "stream_cut"),
    "stall": (CHAT_PARTIAL, "stall_timeout", "stall_timeout"),
    "stray": (chat("x") + STRAY, "eof", "503"),  # the upstream's own code, carried over (the SDK makes it text)
    "foreign": (chat("x") + BARE_ERROR, None, "503"),
    "early_done": (chat("x") + DONE, None, "stream_cut"),
}


@pytest.mark.parametrize("case", sorted(OPENAI_FAILURES))
def test_chat_failures_raise_api_error(case: str) -> None:
    upstream, end, code = OPENAI_FAILURES[case]
    with pytest.raises(openai.APIError) as info:
        chat_text(guarded("chat_completions", upstream, end))
    assert not isinstance(info.value, openai.APIStatusError)
    assert info.value.code == code


def test_responses_failure_raises_api_error() -> None:
    with pytest.raises(openai.APIError) as info:
        responses_types(guarded("responses", RESPONSES_BODY, "eof"))
    assert info.value.code == "stream_cut"


def test_responses_flat_upstream_error_is_reshaped_so_the_sdk_raises() -> None:
    flat = b'event: error\ndata: {"type":"error","code":"ERR","message":"bad","param":null,"sequence_number":6}\n\n'
    with pytest.raises(openai.APIError) as info:
        responses_types(guarded("responses", RESPONSES_BODY + flat))
    assert (info.value.message, info.value.code) == ("bad", "ERR")


@pytest.mark.parametrize(
    ("upstream", "end"),
    [
        (MESSAGES_BODY, "eof"),
        (MESSAGES_BODY, "shutdown"),
        (MESSAGES_BODY + b'event: error\ndata: {"code": 500, "message": "bad", "type": "server_error"}\n\n', None),
        (MESSAGES_BODY + STRAY, "eof"),
    ],
)
def test_messages_failures_raise_status_error(upstream: bytes, end: str | None) -> None:
    with pytest.raises(anthropic.APIStatusError) as info:
        messages_types(guarded("messages", upstream, end))
    assert info.value.type in {"api_error", "overloaded_error"}


def test_messages_missing_stop_is_added() -> None:
    assert messages_types(guarded("messages", MESSAGES_BODY + MESSAGES_STOP_DELTA))[-1] == "message_stop"
    assert MESSAGE_STOP in guarded("messages", MESSAGES_BODY + MESSAGES_STOP_DELTA)
