"""StreamGuard verdicts (design section 5), each fed whole, split at every byte and byte by byte."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from anthropic._streaming import SSEDecoder as AnthropicDecoder
from hypothesis import given, settings
from hypothesis import strategies as st
from openai._streaming import SSEDecoder as OpenAIDecoder

from proxy.core.dialects import DIALECTS, Usage
from proxy.core.guard import Failure, Step, StreamGuard
from proxy.core.verdicts import Outcome, Reason

# ---- upstream streams --------------------------------------------------------------------------


def data(obj: object) -> bytes:
    payload = obj if isinstance(obj, bytes) else orjson.dumps(obj)
    return b"data: " + payload + b"\n\n"


def named(obj: dict[str, Any]) -> bytes:
    return b"event: " + str(obj["type"]).encode() + b"\n" + data(obj)


def chat(content: str | None = None, finish: str | None = None, role: bool = False, index: int = 0) -> bytes:
    d: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": content}
    choice = {"index": index, "delta": d, "finish_reason": finish}
    return data({"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m", "choices": [choice]})


def text(content: str, finish: str | None = None, index: int = 0) -> bytes:
    choice = {"index": index, "text": content, "finish_reason": finish}
    return data({"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [choice]})


DONE = b"data: [DONE]\n\n"
CHAT_USAGE = data({"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}})
CHAT_BODY = chat(role=True) + chat("Hel") + b": keep-alive\n\n" + chat("lo") + chat(None, "stop")
COMPLETIONS_BODY = text("") + text("Hel") + text("lo", "length")

RESPONSE = {"id": "resp_1", "object": "response", "created_at": 5, "model": "m", "status": "in_progress"}
RESPONSES_PRELUDE = named({"type": "response.created", "sequence_number": 0, "response": RESPONSE}) + named(
    {"type": "response.in_progress", "sequence_number": 1, "response": RESPONSE}
)
RESPONSES_BODY = (
    RESPONSES_PRELUDE
    + named({"type": "response.output_item.added", "sequence_number": 2, "output_index": 0})
    + named({"type": "response.output_text.delta", "sequence_number": 3, "delta": "Hel"})
    + named({"type": "response.output_text.delta", "sequence_number": 4, "delta": "lo"})
    + named({"type": "response.output_text.done", "sequence_number": 5, "text": "Hello"})
)
RESPONSES_END = named(
    {
        "type": "response.completed",
        "sequence_number": 6,
        "response": {**RESPONSE, "status": "completed", "usage": {"input_tokens": 4, "output_tokens": 2}},
    }
)

MESSAGES_PRELUDE = named(
    {"type": "message_start", "message": {"id": "msg_1", "usage": {"input_tokens": 25, "output_tokens": 1}}}
) + named({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
MESSAGES_BODY = (
    MESSAGES_PRELUDE
    + named({"type": "ping"})
    + named({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}})
    + named({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "lo"}})
    + named({"type": "content_block_stop", "index": 0})
)
MESSAGES_STOP_DELTA = named(
    {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 15}}
)
MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'

OTHER_BODY = data({"token": {"text": "Hel"}}) + data({"token": {"text": "lo"}, "generated_text": "Hello"})

# Per dialect: events before content, a body with content (not finished), and its proper ending.
NORMAL = {
    "chat_completions": (chat(role=True), CHAT_BODY, CHAT_USAGE + DONE),
    "completions": (text(""), COMPLETIONS_BODY, DONE),
    "responses": (RESPONSES_PRELUDE, RESPONSES_BODY, RESPONSES_END),
    "messages": (MESSAGES_PRELUDE, MESSAGES_BODY, MESSAGES_STOP_DELTA + MESSAGE_STOP),
    "other": (b"", OTHER_BODY, DONE),
}
UNFINISHED = {  # content produced, generation not finished
    "chat_completions": chat(role=True) + chat("Hel"),
    "completions": text("Hel"),
    "responses": RESPONSES_BODY,
    "messages": MESSAGES_BODY,
}
JSON_DIALECTS = ["chat_completions", "completions", "responses", "messages"]
ALL_STREAMING = [*JSON_DIALECTS, "other"]

# ---- the driver --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    output: bytes
    committed: bool
    outcome: str | None
    reason: str | None
    failure: Failure | None
    rewrites: tuple[str, ...]
    events: int
    content_events: int
    usage: Usage | None
    upstream_message: str | None = None  # what the upstream said, for the log line


def drive(name: str, chunks: list[bytes], *, hold: bool, end: str | None = "eof") -> Result:
    """Feed the chunks, then end the stream (`eof`, a fail reason, or None), checking Step invariants."""
    guard = StreamGuard(DIALECTS[name], hold=hold, max_event_size=4096)
    out: list[bytes] = []
    commits = firsts = 0
    final: Step | None = None

    def apply(step: Step) -> None:
        nonlocal commits, firsts, final
        assert final is None or step == Step(), "a step after done must be empty"
        commits += step.commit
        firsts += step.first_content
        if step.data:
            assert commits == 1, "data before the commit"
            out.append(step.data)
        if step.failure is not None:  # an error ending, worded as a status too
            assert step.done
            assert step.outcome == "error"
            if commits == 0:
                assert not step.data
        if step.done:
            assert step.outcome in {"ok", "error"}
            final = step
        else:
            assert step.outcome is None
            assert step.reason is None
            assert step.failure is None

    for chunk in chunks:
        apply(guard.feed(chunk))
    if end == "eof":
        apply(guard.end_of_stream())
    elif end is not None:
        apply(guard.fail(Reason(end)))
    if final is not None:  # nothing more comes out once done
        for step in (guard.feed(b"data: {}\n\n"), guard.end_of_stream(), guard.fail(Reason.STREAM_CUT), guard.commit()):
            apply(step)
    assert commits <= 1
    assert firsts == (1 if guard.content_events else 0)
    assert guard.released == bool(commits)
    return Result(
        b"".join(out),
        guard.released,
        final.outcome if final else None,
        final.reason if final else None,
        final.failure if final else None,
        tuple(guard.rewrites),
        guard.events,
        guard.content_events,
        guard.usage,
        guard.upstream_message,
    )


def run(name: str, stream: bytes, *, hold: bool = True, end: str | None = "eof") -> Result:
    """The same verdict and bytes whether the stream comes whole, in two pieces at any point, or bytewise."""
    whole = drive(name, [stream], hold=hold, end=end)
    for cut in range(1, len(stream)):
        assert drive(name, [stream[:cut], stream[cut:]], hold=hold, end=end) == whole, cut
    assert drive(name, [stream[i : i + 1] for i in range(len(stream))], hold=hold, end=end) == whole
    return whole


# ---- SDK views of the output ---------------------------------------------------------------------


def openai_events(raw: bytes) -> list[tuple[str | None, Any]]:
    events = []
    for sse in OpenAIDecoder().iter_bytes(iter([raw])):
        events.append((sse.event, sse.data if sse.data.startswith("[DONE]") else json.loads(sse.data)))
    return events


def anthropic_events(raw: bytes) -> list[tuple[str | None, Any]]:
    return [(sse.event, json.loads(sse.data)) for sse in AnthropicDecoder().iter_bytes(iter([raw]))]


def sdk_error(name: str, raw: bytes) -> dict[str, Any]:
    """The error the dialect's SDK raises on this output (it must raise on exactly one)."""
    if name == "messages":
        events = anthropic_events(raw)
        errors = [body for event, body in events if event == "error"]
        assert len(errors) == 1
        assert errors[0]["type"] == "error"
        return dict(errors[0]["error"])
    events = openai_events(raw)
    # openai-python raises on the first object whose `error` is truthy (the message is read from a dict).
    errors = [body for _, body in events if isinstance(body, dict) and body.get("error")]
    assert errors, events
    assert isinstance(errors[0]["error"], dict), errors[0]
    return dict(errors[0]["error"])


def last_event(name: str, raw: bytes) -> tuple[str | None, Any]:
    return (anthropic_events if name == "messages" else openai_events)(raw)[-1]


# ---- normal streams: byte for byte ---------------------------------------------------------------


@pytest.mark.parametrize("hold", [True, False])
@pytest.mark.parametrize("name", ALL_STREAMING)
def test_normal_stream_passes_byte_identical(name: str, hold: bool) -> None:
    _, body, ending = NORMAL[name]
    stream = body + ending
    result = run(name, stream, hold=hold)
    assert result.output == stream
    assert (result.outcome, result.reason, result.rewrites) == ("ok", "complete", ())
    assert result.committed
    assert result.content_events == 2


def test_normal_chat_without_usage_chunk() -> None:
    result = run("chat_completions", CHAT_BODY + DONE)
    assert result.output == CHAT_BODY + DONE
    assert result.usage is not None  # no counts, but the model that answered and why it stopped (traces)
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (None, None)
    assert result.usage.model is not None
    assert result.usage.finish_reasons == ("stop",)
    assert result.events == 5  # 4 chunks + [DONE]; the comment is forwarded but not counted


@pytest.mark.parametrize(
    ("name", "usage"),
    [
        ("chat_completions", Usage(9, 2)),
        ("responses", Usage(4, 2)),
        ("messages", Usage(25, 15)),
        ("other", None),
    ],
)
def test_usage_from_the_stream(name: str, usage: Usage | None) -> None:
    _, body, ending = NORMAL[name]
    assert run(name, body + ending).usage == usage


def test_leading_bom_is_dropped() -> None:
    stream = CHAT_BODY + DONE
    assert run("chat_completions", b"\xef\xbb\xbf" + stream).output == stream


def test_crlf_stream_passes_byte_identical() -> None:
    stream = (CHAT_BODY + DONE).replace(b"\n", b"\r\n")
    result = run("chat_completions", stream)
    assert result.output == stream
    assert result.reason == "complete"


@pytest.mark.parametrize(
    ("ending", "reason"), [(b"", "complete"), (chat("more").replace(b"\n", b"\r\n")[:-2], "stream_cut")]
)
def test_crlf_stream_without_terminal(ending: bytes, reason: str) -> None:
    stream = CHAT_BODY.replace(b"\n", b"\r\n")
    result = run("chat_completions", stream + ending if reason == "complete" else chat("x") + ending)
    if reason == "complete":
        assert result.output == stream + DONE
        assert result.rewrites == ("missing_terminal",)
    else:
        assert result.output.startswith(chat("x"))
        assert sdk_error("chat_completions", result.output[len(chat("x")) :])["code"] == "stream_cut"
    assert result.reason == reason


def test_stray_block_running_to_eof_is_read_at_close() -> None:
    block = b'HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\n\r\n{"detail": "slow down"}'
    result = run("chat_completions", chat(role=True) + block)
    assert result.failure is not None
    assert (result.failure.status, result.failure.headers) == (429, {"Retry-After": "1"})
    assert orjson.loads(result.failure.body)["error"]["message"] == "slow down"
    assert result.reason == "stray_http_block"


def test_terminal_ends_at_once_without_waiting_for_eof() -> None:
    _, body, ending = NORMAL["responses"]
    result = run("responses", body + ending + b"data: [DONE]\n\n", end=None)
    assert result.output == body + ending
    assert result.reason == "complete"


# ---- finished without the terminal ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "stream", "terminal"),
    [
        ("chat_completions", CHAT_BODY + CHAT_USAGE, DONE),
        ("completions", COMPLETIONS_BODY, DONE),
        ("messages", MESSAGES_BODY + MESSAGES_STOP_DELTA, MESSAGE_STOP),
    ],
)
def test_finished_generation_gets_the_missing_terminal(name: str, stream: bytes, terminal: bytes) -> None:
    result = run(name, stream)
    assert result.output == stream + terminal
    assert (result.outcome, result.reason, result.rewrites) == ("ok", "complete", ("missing_terminal",))


def test_messages_done_marker_after_stop_reason_is_replaced_by_message_stop() -> None:
    stream = MESSAGES_BODY + MESSAGES_STOP_DELTA
    result = run("messages", stream + DONE, end=None)
    assert result.output == stream + MESSAGE_STOP
    assert result.rewrites == ("missing_terminal",)


def test_other_stream_eof_is_complete() -> None:
    result = run("other", OTHER_BODY)
    assert result.output == OTHER_BODY
    assert (result.outcome, result.reason, result.rewrites) == ("ok", "complete", ())


# ---- cuts, stalls, shutdown ----------------------------------------------------------------------


@pytest.mark.parametrize("name", JSON_DIALECTS)
@pytest.mark.parametrize(
    ("end", "status"), [("eof", 502), ("stream_cut", 502), ("stall_timeout", 504), ("shutdown", 503)]
)
def test_unfinished_stream_ends_with_the_error_frame(name: str, end: str, status: int) -> None:
    stream = UNFINISHED[name]
    partial = b'data: {"choices": [{"index": 0, "delta": {"content": "lost'
    result = run(name, stream + partial, end=end)
    reason = "stream_cut" if end == "eof" else end
    assert (result.outcome, result.reason, result.rewrites) == ("error", reason, (reason,))
    assert result.output.startswith(stream)
    error = sdk_error(name, result.output[len(stream) :])  # the partial event never reaches the client
    if name != "messages":
        assert error["code"] == reason
        assert error["type"] == ("timeout_error" if status == 504 else "server_error")
        assert last_event(name, result.output)[1] == "[DONE]" or name == "responses"
    else:
        assert error["type"] == {502: "api_error", 503: "overloaded_error", 504: "timeout_error"}[status]


def test_responses_error_frame_continues_sequence_and_id() -> None:
    result = run("responses", RESPONSES_BODY)
    events = openai_events(result.output[len(RESPONSES_BODY) :])
    assert [event for event, _ in events] == ["response.failed", "error"]
    assert events[0][1]["sequence_number"] == 6
    assert events[0][1]["response"]["id"] == "resp_1"
    assert events[1][1]["sequence_number"] == 7


def test_done_while_a_choice_is_unfinished_is_a_cut() -> None:
    stream = chat("a", index=0) + chat("b", index=1) + chat(None, "stop", index=0)
    result = run("chat_completions", stream + DONE + chat("late"), end=None)
    assert (result.outcome, result.reason, result.rewrites) == ("error", "stream_cut", ("stream_cut",))
    events = openai_events(result.output[len(stream) :])
    assert events[0][1]["error"]["code"] == "stream_cut"
    assert events[-1] == (None, "[DONE]")


def test_stall_on_other_dialect_writes_event_error() -> None:
    result = run("other", OTHER_BODY, end="stall_timeout")
    assert result.output.startswith(OTHER_BODY)
    tail = result.output[len(OTHER_BODY) :]
    assert tail.startswith(b"event: error\ndata: ")
    assert tail.endswith(b"\n\n")
    assert orjson.loads(tail.split(b"data: ", 1)[1])["error"]["code"] == "stall_timeout"


def test_oversized_event_is_a_cut() -> None:
    big = b"data: " + b"x" * 5000 + b"\n\n"
    result = drive("chat_completions", [CHAT_BODY, big[:3000], big[3000:]], hold=True)
    assert (result.outcome, result.reason, result.rewrites) == ("error", "stream_cut", ("oversized_event",))
    assert result.output.startswith(CHAT_BODY)
    assert sdk_error("chat_completions", result.output[len(CHAT_BODY) :])["code"] == "stream_cut"


def test_oversized_event_before_content_is_a_real_status() -> None:
    result = drive("chat_completions", [chat(role=True) + b"data: " + b"x" * 5000], hold=True)
    assert result.failure is not None
    assert result.failure.status == 502
    assert (result.reason, result.rewrites) == ("stream_cut", ("oversized_event", "late_commit_status"))


# ---- stray HTTP blocks ---------------------------------------------------------------------------

STRAY_BODY = b'{"error":{"message":"engine busy","code":503}}'
STRAY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 2\r\n"
    b"Connection: close\r\nX-RateLimit-Remaining: 0\r\nContent-Length: %d\r\n\r\n%s" % (len(STRAY_BODY), STRAY_BODY)
)


@pytest.mark.parametrize("name", ALL_STREAMING)
def test_stray_http_block_after_commit_becomes_an_error_frame(name: str) -> None:
    _, body, _ = NORMAL[name]
    result = run(name, body + STRAY)
    assert (result.outcome, result.reason, result.rewrites) == ("error", "stray_http_block", ("stray_http_block",))
    assert result.output.startswith(body)
    assert b"HTTP/1.1" not in result.output
    if name == "other":
        assert b"engine busy" in result.output[len(body) :]
        return
    error = sdk_error(name, result.output[len(body) :])
    assert error["message"] == "engine busy"
    assert result.upstream_message == "engine busy"


@pytest.mark.parametrize("name", ALL_STREAMING)
def test_stray_http_block_before_content_is_a_real_status(name: str) -> None:
    prelude, _, _ = NORMAL[name]
    result = run(name, prelude + b": keep-alive\n\n" + STRAY)
    assert not result.committed
    assert result.output == b""
    expected = ("error", "stray_http_block", ("stray_http_block", "late_commit_status"))
    assert (result.outcome, result.reason, result.rewrites) == expected
    assert result.failure is not None
    assert result.failure.status == 503
    assert result.failure.headers == {"Retry-After": "2", "x-ratelimit-remaining": "0"}
    body = orjson.loads(result.failure.body)
    assert body["error"]["message"] == "engine busy"
    assert DIALECTS[name].own_error_shape(body)


def test_stray_block_without_json_uses_the_reason_phrase() -> None:
    block = b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/html\r\n\r\n<html>oops</html>"
    result = run("chat_completions", CHAT_BODY + block)
    error = sdk_error("chat_completions", result.output[len(CHAT_BODY) :])
    assert (error["message"], error["code"], error["type"]) == (
        "Internal Server Error",
        "stray_http_block",
        "server_error",
    )


def test_stray_block_with_odd_status_is_a_502() -> None:
    block = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    result = run("chat_completions", chat("x") + block + chat("y"), end=None)
    assert result.reason == "stray_http_block"
    assert sdk_error("chat_completions", result.output)["type"] == "server_error"


# ---- a backend's own abort (vLLM's finish_reason "abort") ---------------------------------------------

ABORT_CHUNK = {"chat_completions": chat(None, "abort"), "completions": text("", "abort")}


@pytest.mark.parametrize("name", ["chat_completions", "completions"])
def test_abort_after_content_is_an_error_frame_not_a_success(name: str) -> None:
    body = UNFINISHED[name]
    result = run(name, body + ABORT_CHUNK[name] + CHAT_USAGE + DONE)
    assert (result.outcome, result.reason, result.rewrites) == ("error", "upstream_aborted", ("upstream_aborted",))
    assert result.output.startswith(body)
    tail = result.output[len(body) :]
    assert b'"abort"' not in tail  # the abort chunk is replaced, not forwarded
    error = sdk_error(name, tail)
    assert (error["code"], error["type"]) == ("upstream_aborted", "server_error")
    assert "abort" in error["message"]
    assert openai_events(tail)[-1] == (None, "[DONE]")


@pytest.mark.parametrize("name", ["chat_completions", "completions"])
def test_abort_before_content_is_a_real_502(name: str) -> None:
    preamble = NORMAL[name][0]
    result = run(name, preamble + ABORT_CHUNK[name] + DONE)
    assert (result.outcome, result.reason) == ("error", "upstream_aborted")
    assert result.rewrites == ("upstream_aborted", "late_commit_status")
    assert not result.committed
    assert result.failure is not None
    assert result.failure.status == 502
    assert orjson.loads(result.failure.body)["error"]["code"] == "upstream_aborted"


def test_abort_chunk_that_carries_the_last_content_still_fails() -> None:
    body = UNFINISHED["chat_completions"]
    result = run("chat_completions", body + chat("lo", "abort") + DONE)
    assert (result.outcome, result.reason) == ("error", "upstream_aborted")


def test_abort_of_one_choice_fails_the_stream_although_the_other_finished() -> None:
    stream = chat("a", index=0) + chat("b", index=1) + chat(None, "stop", index=0)
    result = run("chat_completions", stream + chat(None, "abort", index=1) + DONE)
    assert (result.outcome, result.reason) == ("error", "upstream_aborted")
    assert sdk_error("chat_completions", result.output[len(stream) :])["code"] == "upstream_aborted"


@pytest.mark.parametrize("finish", ["stop", "length", "tool_calls", "content_filter", "function_call"])
def test_openai_finish_reasons_are_not_aborts(finish: str) -> None:
    body = UNFINISHED["chat_completions"]
    result = run("chat_completions", body + chat(None, finish) + DONE)
    assert (result.outcome, result.reason) == ("ok", "complete")


# ---- upstream error frames -----------------------------------------------------------------------

CHAT_NATIVE = data({"error": {"message": "engine died", "type": "InternalServerError", "param": None, "code": 500}})


@pytest.mark.parametrize("name", ["chat_completions", "completions"])
def test_native_error_passes_and_gets_done_without_waiting(name: str) -> None:
    body = UNFINISHED[name]
    result = run(name, body + CHAT_NATIVE + chat("ignored"), end=None)
    assert result.output == body + CHAT_NATIVE + DONE
    assert (result.outcome, result.reason, result.rewrites) == ("error", "upstream_error_frame", ())


def test_native_error_then_upstream_done_is_not_doubled() -> None:
    body = UNFINISHED["chat_completions"]
    result = run("chat_completions", body + CHAT_NATIVE + DONE)
    assert result.output == body + CHAT_NATIVE + DONE


def test_responses_failed_gets_the_error_event() -> None:
    failed = named(
        {
            "type": "response.failed",
            "sequence_number": 6,
            "response": {**RESPONSE, "status": "failed", "error": {"code": "server_error", "message": "died"}},
        }
    )
    result = run("responses", RESPONSES_BODY + failed)
    assert result.output.startswith(RESPONSES_BODY + failed)
    events = openai_events(result.output[len(RESPONSES_BODY + failed) :])
    assert [event for event, _ in events] == ["error"]
    assert events[0][1]["sequence_number"] == 7
    assert events[0][1]["error"]["message"] == "died"
    assert result.reason == "upstream_error_frame"


def test_responses_nested_error_becomes_failed_then_error() -> None:
    err = named(
        {"type": "error", "sequence_number": 6, "error": {"type": "server_error", "code": "x", "message": "died"}}
    )
    result = run("responses", RESPONSES_BODY + err)
    events = openai_events(result.output[len(RESPONSES_BODY) :])
    assert [event for event, _ in events] == ["response.failed", "error"]
    assert [body["sequence_number"] for _, body in events] == [6, 7]  # the dropped upstream error's 6 is reused
    assert events[1][1]["code"] == events[1][1]["error"]["code"] == "x"
    assert result.rewrites == ("foreign_error_frame",)


def test_messages_native_error_passes_as_is() -> None:
    err = named({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
    result = run("messages", MESSAGES_BODY + err + MESSAGE_STOP, end=None)
    assert result.output == MESSAGES_BODY + err
    assert sdk_error("messages", result.output)["type"] == "overloaded_error"


def test_other_native_error_passes_as_is() -> None:
    err = data({"error": "Request failed during generation", "error_type": "generation"})
    result = run("other", OTHER_BODY + err + OTHER_BODY, end=None)
    assert result.output == OTHER_BODY + err
    assert (result.outcome, result.reason) == ("error", "upstream_error_frame")


FOREIGN = {
    "flat_object_error": data({"object": "error", "message": "bad things", "type": "x", "param": None, "code": 503}),
    "string_error": data({"error": "bad things", "error_type": "overloaded"}),
    "detail": data({"detail": "bad things"}),
    "bare_error_field": b'error: {"code": 503, "message": "bad things", "type": "unavailable_error"}\n\n',
    "event_error_flat": b'event: error\ndata: {"code": 503, "message": "bad things"}\n\n',
}


@pytest.mark.parametrize("shape", sorted(FOREIGN))
@pytest.mark.parametrize("name", JSON_DIALECTS)
def test_foreign_error_is_rewritten(name: str, shape: str) -> None:
    body = UNFINISHED[name]
    result = run(name, body + FOREIGN[shape] + DONE, end=None)
    assert (result.outcome, result.reason, result.rewrites) == (
        "error",
        "upstream_error_frame",
        ("foreign_error_frame",),
    )
    assert result.output.startswith(body)
    error = sdk_error(name, result.output[len(body) :])
    assert error["message"] == "bad things"
    assert result.upstream_message == "bad things"


@pytest.mark.parametrize("name", JSON_DIALECTS)
def test_foreign_error_before_content_is_a_real_status(name: str) -> None:
    prelude, _, _ = NORMAL[name]
    result = run(name, prelude + FOREIGN["flat_object_error"])
    assert result.failure is not None
    expected_status = 502 if FOREIGN["flat_object_error"] is None else 503
    assert result.failure.status == expected_status
    assert orjson.loads(result.failure.body)["error"]["message"] == "bad things"
    assert result.rewrites == ("foreign_error_frame", "late_commit_status")
    assert result.events == 0


@pytest.mark.parametrize("name", ["chat_completions", "completions"])
def test_native_error_before_content_is_a_real_status(name: str) -> None:
    prelude, _, _ = NORMAL[name]
    native = data({"error": {"message": "slow down", "type": "rate_limit_error", "code": "rate_limited"}})
    result = run(name, prelude + native)
    assert result.failure == Failure(429, DIALECTS[name].error_body(429, "slow down", "rate_limited"), {})
    assert (result.outcome, result.reason) == ("error", "upstream_error_frame")
    assert result.upstream_message == "slow down"


@pytest.mark.parametrize("name", ["chat_completions", "messages"])
def test_a_cut_stream_has_no_upstream_message(name: str) -> None:
    """Only what the upstream said is logged as its message; a cut is the proxy's own finding."""
    result = run(name, UNFINISHED[name])
    assert (result.outcome, result.reason) == ("error", "stream_cut")
    assert result.upstream_message is None


# ---- malformed events ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad", [b"data: {not json\n\n", b"data:\n\n", b"event: ping\n\n", b"id: 7\n\n", b"data: 42\n\n"]
)
@pytest.mark.parametrize("name", JSON_DIALECTS)
def test_malformed_event_is_dropped_and_the_stream_goes_on(name: str, bad: bytes) -> None:
    _, body, ending = NORMAL[name]
    half = len(NORMAL[name][0])
    result = run(name, body[:half] + bad + body[half:] + ending)
    assert result.output == body + ending
    assert (result.outcome, result.reason, result.rewrites) == ("ok", "complete", ("malformed_event",))


def test_malformed_event_passes_in_other() -> None:
    stream = OTHER_BODY + b"data: {not json\n\n"
    assert run("other", stream).output == stream


# ---- late commit ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_STREAMING)
def test_prelude_is_held_until_the_first_content(name: str) -> None:
    prelude, body, _ending = NORMAL[name]
    guard = StreamGuard(DIALECTS[name], hold=True)
    if prelude:
        step = guard.feed(prelude + b": keep-alive\n\n")
        assert step == Step()
        assert not guard.released
    step = guard.feed(body[len(prelude) :])
    assert step.commit
    assert step.first_content
    held = prelude + b": keep-alive\n\n" if prelude else b""
    assert step.data == held + body[len(prelude) :]


def test_hold_window_expiry_commits_and_flushes_held_events() -> None:
    guard = StreamGuard(DIALECTS["chat_completions"], hold=True)
    assert guard.feed(chat(role=True)[:-1]) == Step()
    assert guard.feed(b"\n: ping\n\n") == Step()
    step = guard.commit()
    assert step == Step(commit=True, data=chat(role=True) + b": ping\n\n")
    assert guard.commit() == Step()
    assert guard.events == 1
    step = guard.fail(Reason.STALL_TIMEOUT)  # after the release: the frame, and the status in case the 200 is not out
    assert step.failure is not None
    assert step.failure.status == 504
    assert step.done
    assert sdk_error("chat_completions", step.data)["type"] == "timeout_error"
    assert guard.rewrites == ["stall_timeout"]


def test_commit_of_an_empty_hold() -> None:
    guard = StreamGuard(DIALECTS["messages"], hold=True)
    assert guard.commit() == Step(commit=True)
    assert guard.feed(MESSAGES_PRELUDE) == Step(data=MESSAGES_PRELUDE)


def test_no_hold_commits_at_the_first_call() -> None:
    guard = StreamGuard(DIALECTS["chat_completions"], hold=False)
    assert guard.feed(b"da") == Step(commit=True)
    assert guard.feed(b"ta: [DONE]\n\n") == Step(data=DONE, done=True, outcome=Outcome.OK, reason=Reason.COMPLETE)


@pytest.mark.parametrize(("reason", "status"), [("stream_cut", 502), ("stall_timeout", 504), ("shutdown", 503)])
def test_failure_inside_the_hold_window_is_a_real_status(reason: str, status: int) -> None:
    result = run("messages", MESSAGES_PRELUDE, end=reason)
    assert result.failure is not None
    assert result.failure.status == status
    assert result.failure.headers == {}
    body = orjson.loads(result.failure.body)
    assert body["type"] == "error"
    assert (result.reason, result.rewrites, result.events) == (reason, (reason, "late_commit_status"), 0)


def test_empty_upstream_stream_is_a_cut_before_commit() -> None:
    result = run("chat_completions", b"")
    assert result.failure is not None
    assert result.failure.status == 502
    assert result.reason == "stream_cut"


def test_finished_without_content_commits_at_eof() -> None:
    stream = chat(role=True) + chat(None, "length")
    result = run("chat_completions", stream)
    assert result.output == stream + DONE
    assert result.committed
    assert result.reason == "complete"


# ---- random chunkings ----------------------------------------------------------------------------


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    name=st.sampled_from(ALL_STREAMING),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=12),
    hold=st.booleans(),
)
def test_random_chunking_gives_the_same_result(name: str, cuts: list[int], hold: bool) -> None:
    _, body, ending = NORMAL[name]
    stream = body + FOREIGN["detail"] + ending if name != "other" else body + ending
    points = sorted({min(c, len(stream)) for c in cuts})
    chunks = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    assert drive(name, chunks, hold=hold) == drive(name, [stream], hold=hold)


# ---- fuzz: any upstream bytes give a well-formed ending, never an exception ------------------------

KEYS = [
    "error",
    "choices",
    "delta",
    "content",
    "finish_reason",
    "index",
    "usage",
    "type",
    "message",
    "detail",
    "object",
    "code",
    "response",
    "sequence_number",
    "stop_reason",
    "text",
    "status",
]
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 600)
    | st.sampled_from(["", "x", "error", "stop", "response.failed", "message_stop", "[DONE]", "content_block_delta"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=4),
    max_leaves=12,
)
fuzz_event = st.one_of(
    st.builds(lambda v: data(orjson.dumps(v)), json_values),
    st.builds(
        lambda name, v: b"event: " + name.encode() + b"\n" + data(orjson.dumps(v)),
        st.sampled_from(["error", "message_stop", "response.completed", "ping", "x"]),
        json_values,
    ),
    st.sampled_from([DONE, b": c\n\n", b"error: boom\n\n", b"data: {\n\n", b"id: 1\n\n", STRAY, b"\r\n"]),
)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    name=st.sampled_from([*ALL_STREAMING, "embeddings"]),
    events=st.lists(fuzz_event, max_size=8),
    hold=st.booleans(),
    end=st.sampled_from(["eof", "stream_cut", "stall_timeout", "shutdown"]),
)
def test_any_stream_ends_well_formed(name: str, events: list[bytes], hold: bool, end: str) -> None:
    result = drive(name, [b"".join(events)], hold=hold, end=end)
    assert result.outcome in {"ok", "error"}
    if result.failure is not None:
        assert orjson.loads(result.failure.body)["error"]
        return
    assert result.output[-1:] in {b"", b"\n"}
    if name in {"other", "embeddings"}:
        return
    # Every event a JSON dialect's SDK sees parses (malformed ones were dropped) ...
    seen = (anthropic_events if name == "messages" else openai_events)(result.output)
    assert all(body == "[DONE]" or isinstance(body, dict) for _, body in seen)
    # ... and a stream that ended in error makes it raise.
    if result.outcome == "error":
        assert sdk_error(name, result.output)


@pytest.mark.parametrize(("name", "safe"), [("chat_completions", False), ("responses", False), ("messages", True)])
def test_keepalive_is_unsafe_after_an_upstream_id_in_openai_dialects(name: str, safe: bool) -> None:
    guard = StreamGuard(DIALECTS[name], hold=False)
    assert guard.keepalive_safe
    guard.feed(b"id: 7\n: ping\n\n")
    assert guard.keepalive_safe is safe


def test_events_complete_before_an_oversized_one_in_the_same_read_are_delivered() -> None:
    content = chat(content="Hi")
    big = b"data: " + b"x" * 200 + b"\n\n"
    whole = StreamGuard(DIALECTS["chat_completions"], hold=True, max_event_size=150).feed(content + big)
    assert whole.commit
    assert whole.data.startswith(content)
    assert (whole.done, whole.reason) == (True, "stream_cut")
    split = StreamGuard(DIALECTS["chat_completions"], hold=True, max_event_size=150)
    first = split.feed(content)
    second = split.feed(big)
    assert first.data + second.data == whole.data


# --- the hold window's memory bound -------------------------------------------------------------


@pytest.mark.parametrize("filler", [chat(role=True), b": keep-alive, still thinking\n\n"])
def test_held_bytes_are_bounded_then_committed_in_order(filler: bytes) -> None:
    """An upstream that sends only role chunks or comments cannot make the hold window hold more."""
    guard = StreamGuard(DIALECTS["chat_completions"], hold=True, max_held=1000)
    sent: list[bytes] = []
    committed_at = None
    for i in range(100):
        step = guard.feed(filler)
        assert step.failure is None
        assert not step.done
        if step.commit:
            committed_at = i
        sent.append(step.data)
    assert committed_at == 1000 // len(filler)  # the first feed that goes past the bound commits
    assert b"".join(sent) == filler * 100  # nothing lost, nothing reordered
    step = guard.feed(chat("Hi") + chat(None, "stop") + DONE)
    assert step.done
    assert step.outcome == "ok"


def test_below_the_hold_bound_nothing_is_committed_early() -> None:
    guard = StreamGuard(DIALECTS["chat_completions"], hold=True, max_held=1000)
    step = guard.feed(chat(role=True) * 3)
    assert not step.commit
    assert not step.data
