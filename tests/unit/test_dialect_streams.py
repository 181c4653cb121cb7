"""Per-dialect event classification: content, finish tracking, usage, and every error shape."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.core.dialects import DIALECTS, DialectStream, Kind, Usage
from proxy.core.dialects.responses import ResponsesStream
from proxy.core.sse import Event


def ev(obj: Any, event: str | None = None) -> Event:
    data = obj if isinstance(obj, bytes) else orjson.dumps(obj)
    head = b"event: " + event.encode() + b"\n" if event else b""
    return Event(raw=head + b"data: " + data + b"\n\n", event=event, data=data, has_data=True)


def named(obj: dict[str, Any]) -> Event:
    return ev(obj, event=obj["type"])


def chunk(*choices: dict[str, Any], usage: Any = None) -> Event:
    return ev({"id": "c", "object": "chat.completion.chunk", "choices": list(choices), "usage": usage})


def delta(content: str | None = None, index: int = 0, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"content": content, **extra}
    return {"index": index, "delta": d, "finish_reason": finish}


DONE = Event(raw=b"data: [DONE]\n\n", data=b"[DONE]", has_data=True)


def stream(name: str) -> DialectStream:
    return DIALECTS[name].new_stream()


# ---- chat completions / completions -------------------------------------------------------------


def test_chat_role_only_chunk_is_prelude_then_content() -> None:
    s = stream("chat_completions")
    assert s.classify(chunk({"index": 0, "delta": {"role": "assistant", "content": ""}})) is Kind.PASS
    assert s.classify(chunk(delta("Hi"))) is Kind.CONTENT
    assert not s.finished
    assert s.classify(chunk(delta(None, finish="stop"))) is Kind.PASS
    assert s.finished
    assert s.classify(DONE) is Kind.TERMINAL


@pytest.mark.parametrize(
    "d",
    [
        {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]},
        {"reasoning_content": "hmm"},
        {"refusal": "no"},
        {"content": None, "function_call": {"name": "f"}},
    ],
)
def test_chat_non_text_deltas_are_content(d: dict[str, Any]) -> None:
    assert stream("chat_completions").classify(chunk({"index": 0, "delta": d})) is Kind.CONTENT


def test_completions_text_is_content() -> None:
    s = stream("completions")
    assert s.classify(chunk({"index": 0, "text": "", "finish_reason": None})) is Kind.PASS
    assert s.classify(chunk({"index": 0, "text": "x", "finish_reason": None})) is Kind.CONTENT
    assert s.classify(chunk({"index": 0, "text": "", "finish_reason": "length"})) is Kind.PASS
    assert s.finished


@pytest.mark.parametrize("name", ["chat_completions", "completions"])
def test_abort_finish_reason_is_classified_aborted(name: str) -> None:
    s = stream(name)
    assert s.classify(chunk(delta("x"))) is Kind.CONTENT
    assert s.classify(chunk(delta(None, finish="abort"))) is Kind.ABORTED
    assert s.error is not None
    assert (s.error.status, s.error.code) == (502, "upstream_aborted")
    assert not s.finished


def test_chat_finished_needs_every_seen_choice() -> None:
    s = stream("chat_completions")
    s.classify(chunk(delta("a", 0), delta("b", 1)))
    s.classify(chunk(delta(None, 0, finish="stop")))
    assert not s.finished
    assert s.classify(DONE) is Kind.EARLY_DONE
    s.classify(chunk(delta(None, 1, finish="length")))
    assert s.finished
    assert s.classify(DONE) is Kind.TERMINAL


def test_chat_done_without_any_choice_is_terminal() -> None:
    s = stream("chat_completions")
    assert not s.finished
    assert s.classify(DONE) is Kind.TERMINAL


def test_chat_done_after_role_only_choice_is_terminal() -> None:
    s = stream("chat_completions")
    s.classify(chunk({"index": 0, "delta": {"role": "assistant"}}))
    assert s.classify(DONE) is Kind.TERMINAL  # nothing was produced, so nothing was cut short


def test_chat_usage_takes_the_last_one() -> None:
    s = stream("chat_completions")
    s.classify(chunk(delta("a"), usage={"prompt_tokens": 9, "completion_tokens": 1}))
    s.classify(chunk(delta("b"), usage=None))
    assert s.usage == Usage(9, 1)
    s.classify(chunk(usage={"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}))
    assert s.usage == Usage(9, 2)


@pytest.mark.parametrize(
    ("obj", "status", "code"),
    [  # vLLM >= 0.10.1, vLLM < 0.10.1 / SGLang, llama.cpp, TGI, LMDeploy
        ({"error": {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}}, 400, 400),
        ({"error": {"object": "error", "message": "bad", "code": 503}}, 503, 503),
        ({"error": {"code": 500, "message": "bad", "type": "server_error"}}, 500, 500),
        ({"error": {"message": "bad", "http_status_code": 422}}, 422, None),
        ({"error": {"message": "bad", "type": "x", "code": "engine_dead", "object": "error"}}, 502, "engine_dead"),
        ({"error": {"message": "bad", "type": "rate_limit_error"}}, 429, None),
    ],
)
def test_chat_native_errors(obj: dict[str, Any], status: int, code: str | int | None) -> None:
    s = stream("chat_completions")
    assert s.classify(ev(obj)) is Kind.ERROR
    assert s.error is not None
    assert (s.error.status, s.error.message, s.error.code) == (status, "bad", code)
    assert s.error_tail() == b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    ("event", "obj", "status"),
    [
        (None, {"object": "error", "message": "bad", "type": "x", "param": None, "code": 429}, 429),
        (None, {"error": "bad", "error_type": "overloaded"}, 502),
        (None, {"detail": "bad"}, 502),
        (None, {"message": "bad"}, 502),
        ("error", {"message": "bad", "code": 504}, 504),
        (None, {"type": "error", "error": "bad"}, 502),
    ],
)
def test_chat_foreign_errors(event: str | None, obj: dict[str, Any], status: int) -> None:
    s = stream("chat_completions")
    assert s.classify(ev(obj, event=event)) is Kind.FOREIGN
    assert s.error is not None
    assert (s.error.status, s.error.message) == (status, "bad")


def test_chat_null_error_field_is_not_an_error() -> None:
    s = stream("chat_completions")
    assert s.classify(ev({"choices": [delta("x")], "error": None})) is Kind.CONTENT


def test_chat_unknown_object_without_choices_passes() -> None:
    assert stream("chat_completions").classify(ev({"id": "x", "object": "keepalive"})) is Kind.PASS


# ---- responses ----------------------------------------------------------------------------------

CREATED = {
    "type": "response.created",
    "sequence_number": 0,
    "response": {"id": "resp_9", "object": "response", "created_at": 17, "model": "m", "status": "in_progress"},
}


def _frames(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.split(b"\n\n")[:-1]:
        lines = dict(line.split(b": ", 1) for line in block.split(b"\n"))
        body = orjson.loads(lines[b"data"])
        assert lines[b"event"].decode() == body["type"]
        out.append(body)
    return out


def test_responses_classification_and_usage() -> None:
    s = stream("responses")
    assert s.classify(named(CREATED)) is Kind.PASS
    assert s.classify(named({"type": "response.in_progress", "sequence_number": 1})) is Kind.PASS
    assert s.classify(named({"type": "response.output_item.added", "sequence_number": 2})) is Kind.PASS
    text = {"type": "response.output_text.delta", "sequence_number": 3, "delta": "Hi"}
    assert s.classify(named(text)) is Kind.CONTENT
    assert s.classify(named({**text, "delta": ""})) is Kind.PASS
    assert not s.finished
    usage = {"input_tokens": 5, "output_tokens": 7, "total_tokens": 12}
    done = {"type": "response.completed", "sequence_number": 4, "response": {"id": "resp_9", "usage": usage}}
    assert s.classify(named(done)) is Kind.TERMINAL
    assert s.usage == Usage(5, 7)
    assert s.terminal_frame() is None


@pytest.mark.parametrize("terminal", ["response.completed", "response.incomplete"])
def test_responses_terminals(terminal: str) -> None:
    assert stream("responses").classify(named({"type": terminal, "sequence_number": 1})) is Kind.TERMINAL


def test_responses_done_marker_is_an_end() -> None:
    assert stream("responses").classify(DONE) is Kind.END


def test_responses_error_frame_continues_the_response() -> None:
    s = stream("responses")
    s.classify(named(CREATED))
    s.classify(named({"type": "response.output_text.delta", "sequence_number": 6, "delta": "x"}))
    failed, error = _frames(s.error_frame(429, "slow down", None))
    assert failed["sequence_number"] == 7
    assert failed["response"]["id"] == "resp_9"
    assert failed["response"]["model"] == "m"
    assert failed["response"]["created_at"] == 17
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "rate_limit_exceeded", "message": "slow down"}
    assert error["sequence_number"] == 8
    assert error["code"] == error["error"]["code"] == "rate_limit_exceeded"
    assert error["message"] == error["error"]["message"] == "slow down"
    assert error["param"] is None
    assert error["error"]["type"] == "rate_limit_error"


@pytest.mark.parametrize(
    "upstream_error",
    [
        {"type": "error", "sequence_number": 5, "code": "ERR", "message": "bad", "param": None},
        {"type": "error", "sequence_number": 5, "error": {"type": "server_error", "code": "ERR", "message": "bad"}},
    ],
    ids=["flat", "nested"],
)
def test_responses_rebuilt_error_takes_the_next_sequence_numbers(upstream_error: dict[str, Any]) -> None:
    """The upstream's own `error` (seq 5) is rebuilt, not passed: the proxy's pair is 5 and 6, not 6 and 7."""
    s = stream("responses")
    s.classify(named(CREATED))
    s.classify(named({"type": "response.output_text.delta", "sequence_number": 4, "delta": "x"}))
    assert s.classify(named(upstream_error)) is Kind.FOREIGN
    assert s.error is not None
    failed, error = _frames(s.error_frame(s.error.status, s.error.message, s.error.code))
    assert (failed["sequence_number"], error["sequence_number"]) == (5, 6)
    assert error["code"] == "ERR"  # the upstream's own code, carried over


@pytest.mark.parametrize(("status", "code"), [(400, "invalid_prompt"), (502, "server_error"), (504, "server_error")])
def test_responses_failed_code_per_status(status: int, code: str) -> None:
    failed, error = _frames(stream("responses").error_frame(status, "m", "stream_cut"))
    assert failed["sequence_number"] == 0
    assert failed["response"]["error"]["code"] == code
    assert error["code"] == "stream_cut"


def test_responses_upstream_failed_gets_the_error_event_added() -> None:
    s = stream("responses")
    s.classify(named(CREATED))
    failed = {
        "type": "response.failed",
        "sequence_number": 3,
        "response": {
            "id": "resp_9",
            "status": "failed",
            "error": {"code": "rate_limit_exceeded", "message": "too many"},
            "usage": {"input_tokens": 3, "output_tokens": 0},
        },
    }
    assert s.classify(named(failed)) is Kind.ERROR
    assert s.error is not None
    assert (s.error.status, s.error.message, s.error.code) == (429, "too many", "rate_limit_exceeded")
    assert s.usage == Usage(3, 0)
    (error,) = _frames(s.error_tail())
    assert error["type"] == "error"
    assert error["sequence_number"] == 4
    assert error["error"]["message"] == "too many"


def test_responses_upstream_nested_error_is_rebuilt_as_the_pair() -> None:
    s = stream("responses")
    s.classify(named(CREATED))
    nested = {
        "type": "error",
        "sequence_number": 2,
        "error": {"type": "too_many_requests", "code": "too_many_requests", "message": "Too Many", "param": None},
    }
    assert s.classify(named(nested)) is Kind.FOREIGN
    assert s.error is not None
    failed, error = _frames(s.error_frame(s.error.status, s.error.message, s.error.code))
    assert (failed["type"], error["type"]) == ("response.failed", "error")
    assert (failed["sequence_number"], error["sequence_number"]) == (1, 2)  # next after the last one passed
    assert failed["response"]["id"] == "resp_9"
    assert error["message"] == error["error"]["message"] == "Too Many"


def test_responses_flat_error_is_foreign() -> None:
    s = stream("responses")
    flat = {"type": "error", "code": "ERR", "message": "went wrong", "param": None, "sequence_number": 1}
    assert s.classify(named(flat)) is Kind.FOREIGN
    assert s.error is not None
    assert (s.error.message, s.error.code) == ("went wrong", "ERR")


@pytest.mark.parametrize(
    "obj", [{"error": {"message": "bad", "code": 500}}, {"object": "error", "message": "bad"}, {"detail": "bad"}]
)
def test_responses_other_error_shapes_are_foreign(obj: dict[str, Any]) -> None:
    assert stream("responses").classify(ev(obj)) is Kind.FOREIGN


def test_responses_failed_without_known_code() -> None:
    s = ResponsesStream()
    assert s.classify(named({"type": "response.failed", "sequence_number": 1, "response": {}})) is Kind.ERROR
    assert s.error is not None
    assert s.error.status == 502


# ---- messages -----------------------------------------------------------------------------------

START = {
    "type": "message_start",
    "message": {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "usage": {"input_tokens": 25, "output_tokens": 1},
    },
}


def test_messages_classification_and_usage() -> None:
    s = stream("messages")
    assert s.classify(named(START)) is Kind.PASS
    assert s.usage == Usage(25, None)  # message_start's output_tokens is a placeholder, not a count
    assert s.classify(named({"type": "ping"})) is Kind.PASS
    assert s.classify(named({"type": "content_block_start", "index": 0})) is Kind.PASS
    block = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}}
    assert s.classify(named(block)) is Kind.CONTENT
    assert s.classify(named({"type": "content_block_stop", "index": 0})) is Kind.PASS
    assert not s.finished
    stop = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 15}}
    assert s.classify(named(stop)) is Kind.PASS
    assert s.finished
    assert s.usage == Usage(25, 15)
    assert s.classify(named({"type": "message_stop"})) is Kind.TERMINAL


def test_messages_delta_without_stop_reason_is_not_finished() -> None:
    s = stream("messages")
    s.classify(named({"type": "message_delta", "delta": {"stop_reason": None}, "usage": {"output_tokens": 3}}))
    assert not s.finished
    assert s.usage == Usage(None, 3)


def test_messages_native_error() -> None:
    s = stream("messages")
    obj = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    assert s.classify(named(obj)) is Kind.ERROR
    assert s.error is not None
    assert (s.error.status, s.error.message) == (529, "Overloaded")
    assert s.error_tail() == b""


@pytest.mark.parametrize(
    ("event", "obj"),
    [
        ("error", {"code": 500, "message": "bad", "type": "server_error"}),  # llama.cpp
        (None, {"type": "error", "error": {"type": "api_error", "message": "bad"}}),  # no event line
        (None, {"error": {"message": "bad", "code": 500}}),  # OpenAI shape
        (None, {"object": "error", "message": "bad", "code": 500}),
        ("error", {"type": "error", "error": "bad"}),
    ],
)
def test_messages_foreign_errors(event: str | None, obj: dict[str, Any]) -> None:
    s = stream("messages")
    assert s.classify(ev(obj, event=event)) is Kind.FOREIGN
    assert s.error is not None
    assert s.error.message == "bad"


def test_messages_frame_without_event_line_passes() -> None:
    assert stream("messages").classify(ev({"type": "content_block_delta"})) is Kind.PASS


def test_messages_done_marker_is_an_end() -> None:
    assert stream("messages").classify(DONE) is Kind.END


# ---- other --------------------------------------------------------------------------------------


def test_other_passes_everything_as_content() -> None:
    s = stream("other")
    assert s.finished
    assert s.classify(ev({"token": {"text": "x"}})) is Kind.CONTENT
    assert s.classify(ev(b"plain text")) is Kind.CONTENT
    assert s.classify(ev({"text": 'mentions "error" in passing', "error": None})) is Kind.CONTENT
    assert s.classify(DONE) is Kind.TERMINAL


def test_other_errors() -> None:
    s = stream("other")
    assert s.classify(ev({"error": "boom", "error_type": "generation"})) is Kind.ERROR
    assert s.error is not None
    assert s.error.message == "boom"
    s = stream("other")
    assert s.classify(ev(b"not json", event="error")) is Kind.ERROR
    assert s.error is not None
    assert s.error.message == "not json"
