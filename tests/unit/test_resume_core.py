"""--resume-on-cut's sans-IO core: the refusal rules, the continuation request, the stitcher, and the
guard that asks before it ends a committed stream (fed whole, at every split and byte by byte)."""

from __future__ import annotations

import itertools
import tracemalloc
from typing import Any

import orjson
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from proxy.core.dialects import DIALECTS
from proxy.core.guard import Step, StreamGuard
from proxy.core.resume import Refusal, Resumer, Stitcher, Transcript, continuation_body, request_refusal
from proxy.core.resume.rules import cut_refusal, parse_request, retry_delay
from proxy.core.sse import Event, SSEReader
from proxy.core.verdicts import Reason

# ---- streams -----------------------------------------------------------------------------------

FIRST = {"id": "chatcmpl-first", "created": 100, "model": "m-first", "system_fingerprint": "fp-first"}
SECOND = {"id": "chatcmpl-second", "created": 200, "model": "m-second", "system_fingerprint": "fp-second"}


def data(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chunk(who: dict[str, Any], delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish, **extra}
    return data({**who, "object": "chat.completion.chunk", "choices": [choice]})


def text_chunk(who: dict[str, Any], text: str, finish: str | None = None, **extra: Any) -> bytes:
    return data({**who, "object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish,
                                                                   **extra}]})


def usage(who: dict[str, Any], prompt: int, completion: int) -> bytes:
    counts = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return data({**who, "object": "chat.completion.chunk", "choices": [], "usage": counts})


DONE = b"data: [DONE]\n\n"
ROLE = {"role": "assistant", "content": ""}
WORDS = ["The", " cat", " sat", " on", " the", " mat"]

# An uncut answer of six tokens for a prompt of 9, and the same answer cut after three.
UNCUT = (
    chunk(FIRST, ROLE) + b"".join(chunk(FIRST, {"content": w}) for w in WORDS)
    + chunk(FIRST, {}, "length") + usage(FIRST, 9, 6) + DONE
)
HEAD = chunk(FIRST, ROLE) + b"".join(chunk(FIRST, {"content": w}) for w in WORDS[:3])
SO_FAR = "".join(WORDS[:3])


def continuation(echo: bool) -> bytes:
    """A backend continuing after "The cat sat": prompt 9 + 3, three more tokens; llama-server style echo or not."""
    first = SO_FAR + WORDS[3] if echo else WORDS[3]
    return (
        chunk(SECOND, {"role": "assistant", "content": None}) + chunk(SECOND, {"content": first})
        + b"".join(chunk(SECOND, {"content": w}) for w in WORDS[4:])
        + chunk(SECOND, {}, "length") + usage(SECOND, 12, 3) + DONE
    )


CHAT_REQUEST = {
    "model": "m", "stream": True, "messages": [{"role": "user", "content": "Say it."}], "max_tokens": 6,
    "temperature": 0, "seed": 7, "stream_options": {"include_usage": True}, "top_p": 0.5,
}


def events(stream: bytes) -> list[Event]:
    reader = SSEReader()
    return [item for item in reader.feed(stream) + reader.close() if isinstance(item, Event)]


def objects(stream: bytes) -> list[Any]:
    return [orjson.loads(e.data) if e.data != b"[DONE]" else "[DONE]" for e in events(stream) if e.data]


def transcript_of(stream: bytes) -> Transcript:
    transcript = Transcript()
    for obj in objects(stream):
        if obj != "[DONE]":
            transcript.note(obj)
    return transcript


# ---- the refusal rules -----------------------------------------------------------------------------

REFUSED = [
    {"tools": [{"type": "function", "function": {"name": "f"}}]},
    {"tool_choice": "auto"},
    {"functions": [{"name": "f"}]},
    {"function_call": "auto"},
    {"n": 2},
    {"best_of": 3},
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
    {"guided_json": {"type": "object"}},
    {"guided_regex": "a+"},
    {"guided_grammar": "root ::= x"},
    {"guided_choice": ["a", "b"]},
    {"structured_outputs": {"json": {}}},
    {"grammar": "root ::= x"},
    {"json_schema": {"type": "object"}},
    {"logprobs": True},
    {"logprobs": 0},
    {"top_logprobs": 2},
    {"echo": True},
    {"stream": False},
    {"max_tokens": "10"},
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
    {"messages": []},
]


@pytest.mark.parametrize("extra", REFUSED, ids=lambda e: "-".join(f"{k}={v}" for k, v in e.items())[:40])
def test_requests_a_continuation_cannot_be_faithful_to_are_refused(extra: dict[str, Any]) -> None:
    with pytest.raises(Refusal):
        request_refusal("chat_completions", {**CHAT_REQUEST, **extra})


@pytest.mark.parametrize("extra", [{}, {"response_format": {"type": "text"}}, {"logprobs": False}, {"n": 1},
                                   {"tools": []}, {"tool_choice": None}, {"stop": ["\n"]}, {"logit_bias": {"5": -1}}])
def test_plain_requests_are_accepted(extra: dict[str, Any]) -> None:
    request_refusal("chat_completions", {**CHAT_REQUEST, **extra})


@pytest.mark.parametrize("prompt", [["a", "b"], [[1, 2], [3]], 5, None, []])
def test_completions_batches_and_non_prompts_are_refused(prompt: object) -> None:
    with pytest.raises(Refusal):
        request_refusal("completions", {"model": "m", "stream": True, "prompt": prompt})


@pytest.mark.parametrize(("api", "body"), [("responses", b'{"stream":true}'), ("chat_completions", b"{nope"),
                                           ("chat_completions", b"[1]"), ("messages", b"{}")])
def test_other_apis_and_unreadable_bodies_are_refused(api: str, body: bytes) -> None:
    with pytest.raises(Refusal):
        parse_request(api, body)


def test_an_answer_with_reasoning_or_its_budget_used_is_not_continued() -> None:
    reasoning = transcript_of(chunk(FIRST, {"reasoning_content": "hmm"}) + chunk(FIRST, {"content": "A"}))
    with pytest.raises(Refusal, match="other than text"):
        cut_refusal(CHAT_REQUEST, reasoning)
    with pytest.raises(Refusal, match="max_tokens"):
        cut_refusal({**CHAT_REQUEST, "max_tokens": 3}, transcript_of(HEAD))
    with pytest.raises(Refusal, match="nothing"):
        cut_refusal(CHAT_REQUEST, transcript_of(chunk(FIRST, ROLE)))
    cut_refusal({**CHAT_REQUEST, "max_tokens": 4}, transcript_of(HEAD))


# ---- the continuation request -------------------------------------------------------------------


def test_chat_continuation_appends_the_answer_and_keeps_every_other_field() -> None:
    body = orjson.loads(continuation_body("chat_completions", CHAT_REQUEST, transcript_of(HEAD)))
    assert body["messages"] == [*CHAT_REQUEST["messages"], {"role": "assistant", "content": SO_FAR}]
    assert body["continue_final_message"] is True
    assert body["add_generation_prompt"] is False
    assert body["max_tokens"] == 3
    rest = {k: v for k, v in body.items() if k not in ("messages", "continue_final_message", "add_generation_prompt",
                                                       "max_tokens")}
    assert rest == {k: v for k, v in CHAT_REQUEST.items() if k not in ("messages", "max_tokens")}


def test_a_client_prefill_is_continued_in_place_and_both_budgets_lowered() -> None:
    request = {**CHAT_REQUEST, "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "Once"}],
               "continue_final_message": True, "add_generation_prompt": False, "max_completion_tokens": 10,
               "min_tokens": 2}
    body = orjson.loads(continuation_body("chat_completions", request, transcript_of(HEAD)))
    assert body["messages"][-1] == {"role": "assistant", "content": "Once" + SO_FAR}
    assert len(body["messages"]) == 2
    assert (body["max_tokens"], body["max_completion_tokens"], body["min_tokens"]) == (3, 7, 0)


def test_completions_continue_the_prompt_with_text_or_token_for_token() -> None:
    request = {"model": "m", "stream": True, "prompt": "Once", "max_tokens": 5}
    head = text_chunk(FIRST, " upon") + text_chunk(FIRST, " a")
    body = orjson.loads(continuation_body("completions", request, transcript_of(head)))
    assert body["prompt"] == "Once upon a"
    assert body["max_tokens"] == 3
    # vLLM with return_token_ids: the prompt's ids come first, then one or more ids per chunk
    with_ids = (text_chunk(FIRST, " upon", token_ids=[11], prompt_token_ids=[1, 5])
                + text_chunk(FIRST, "", token_ids=[12]) + text_chunk(FIRST, " a", token_ids=[13]))
    transcript = transcript_of(with_ids)
    assert transcript.produced == 3
    body = orjson.loads(continuation_body("completions", request, transcript))
    assert body["prompt"] == [1, 5, 11, 12, 13]
    assert body["max_tokens"] == 2
    with pytest.raises(Refusal, match="token-id prompt"):
        continuation_body("completions", {**request, "prompt": [1, 5]}, transcript_of(head))


# ---- the stitcher -----------------------------------------------------------------------------------


def stitched(transcript: Transcript, stream: bytes) -> list[Any]:
    stitcher = Stitcher(transcript)
    out = [stitcher.rewrite(e) for e in events(stream)]
    return objects(b"".join(e.raw for e in out if e is not None))


@pytest.mark.parametrize("echo", [False, True], ids=["no-echo", "echo"])
def test_the_continuation_reads_as_the_rest_of_the_first_stream(echo: bool) -> None:
    rest = stitched(transcript_of(HEAD), continuation(echo))
    whole = objects(HEAD) + rest
    assert whole == objects(UNCUT)


def test_only_a_first_delta_holding_the_whole_answer_is_an_echo() -> None:
    transcript = transcript_of(chunk(FIRST, ROLE) + chunk(FIRST, {"content": "ab"}) + chunk(FIRST, {"content": "c"}))
    rest = stitched(transcript, chunk(SECOND, {"content": "ab"}) + chunk(SECOND, {"content": "abcX"}))
    assert [c["choices"][0]["delta"]["content"] for c in rest] == ["ab", "abcX"]  # only the first can echo
    rest = stitched(transcript, chunk(SECOND, {"content": "abcX"}))
    assert [c["choices"][0]["delta"]["content"] for c in rest] == ["X"]
    rest = stitched(transcript, chunk(SECOND, {"content": "abc"}) + chunk(SECOND, {}, "stop"))
    assert [c["choices"][0]["delta"] for c in rest] == [{}]  # an echo, then the end: the finish chunk only
    one = transcript_of(chunk(FIRST, ROLE) + chunk(FIRST, {"content": "a"}))
    rest = stitched(one, chunk(SECOND, {"content": "ab"}))
    assert [c["choices"][0]["delta"]["content"] for c in rest] == ["ab"]  # a one-chunk answer is never stripped


def test_errors_comments_and_done_pass_the_stitcher_untouched() -> None:
    stitcher = Stitcher(transcript_of(HEAD))
    for raw in (b": keep-alive\n\n", DONE, data({"error": {"message": "x", "code": 503}}), b"data: {broken\n\n"):
        (event,) = events(raw)
        assert stitcher.rewrite(event) is event


# ---- the guard asks before it ends a committed stream -----------------------------------------------


def run(guard: StreamGuard, stream: bytes, splits: list[int]) -> tuple[bytes, Step]:
    """Feed `stream` cut at `splits`; returns what was written and the last non-empty step."""
    out, last = [], Step()
    cuts = [0, *sorted(set(s % (len(stream) + 1) for s in splits)), len(stream)]
    for a, b in itertools.pairwise(cuts):
        if a == b:
            continue
        step = guard.feed(stream[a:b])
        out.append(step.data)
        if step.done or step.resume:
            return b"".join(out), step
        last = step
    return b"".join(out), last


def resumed_guard(limit: int = 2, request: dict[str, Any] | None = None) -> tuple[StreamGuard, Resumer]:
    resumer = Resumer("chat_completions", orjson.dumps(request or CHAT_REQUEST), limit)
    guard = StreamGuard(DIALECTS["chat_completions"], hold=True, may_resume=resumer.may_resume)
    resumer.watch(guard.stream)
    return guard, resumer


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=4000), max_size=6), st.booleans(),
       st.sampled_from(["eof", "stall_timeout", "stray", "frame"]))
def test_a_cut_stream_continued_gives_the_client_the_uncut_answer(splits: list[int], echo: bool, how: str) -> None:
    guard, resumer = resumed_guard()
    partial = b'data: {"id":"chatcmpl-first","choi'  # bytes of an event the cut left unfinished
    written, step = run(guard, HEAD + partial, splits)
    if how == "eof":
        step = guard.end_of_stream()
    elif how == "stall_timeout":
        step = guard.fail(Reason.STALL_TIMEOUT)
    elif how == "stray":
        step = guard.feed(b"\n\nHTTP/1.0 503 Service Unavailable\r\nRetry-After: 1\r\n\r\n{}\n\n")
    else:
        step = guard.feed(b"\n\n" + data({"error": {"message": "busy", "type": "server_error", "code": 503}}))
    assert step.resume is not None
    assert not step.done
    written += step.data
    guard.resume(resumer.started().rewrite)
    rest, step = run(guard, continuation(echo), splits)
    assert step.done
    assert step.outcome == "ok"
    assert objects(written + rest) == objects(UNCUT)
    assert resumer.resumes == 1
    assert resumer.decisions == [(step_reason(how), "resumed")]
    assert guard.usage is not None
    assert (guard.usage.prompt_tokens, guard.usage.completion_tokens) == (9, 6)


def step_reason(how: str) -> str:
    return {"eof": "stream_cut", "stall_timeout": "stall_timeout", "stray": "stray_http_block",
            "frame": "upstream_error_frame"}[how]


STRAY_503 = b'HTTP/1.0 503 Service Unavailable\r\nRetry-After: 2\r\n\r\n{"error":"busy"}\n\n'
FAILURES = {
    "eof": lambda g: g.end_of_stream(),
    "cut": lambda g: g.fail(Reason.STREAM_CUT),
    "stall": lambda g: g.fail(Reason.STALL_TIMEOUT),
    "stray-503": lambda g: g.feed(STRAY_503),
    "frame-503": lambda g: g.feed(data({"error": {"message": "busy", "type": "server_error", "code": 503}})),
}


@pytest.mark.parametrize("how", list(FAILURES))
def test_giving_up_ends_exactly_as_without_the_flag(how: str) -> None:
    plain = StreamGuard(DIALECTS["chat_completions"], hold=True)
    head, _ = run(plain, HEAD, [])
    end = FAILURES[how](plain)
    guard, _resumer = resumed_guard()
    head2, _ = run(guard, HEAD, [])
    step = FAILURES[how](guard)
    assert step.resume
    assert not step.data
    if how == "stray-503":
        assert guard.retry_after == "2"
    assert guard.upstream_message is None  # (while a continuation is tried, nothing is said yet)
    gave_up = guard.give_up()
    assert (head2, gave_up.data, gave_up.done, gave_up.reason) == (head, end.data, end.done, end.reason)
    assert guard.upstream_message == plain.upstream_message
    assert guard.rewrites == plain.rewrites
    assert guard.events == plain.events


@pytest.mark.parametrize(("failure", "resumes"), [
    (lambda g: g.feed(b"HTTP/1.0 400 Bad Request\r\n\r\nbad\n\n"), False),
    (lambda g: g.feed(data({"error": {"message": "bad", "type": "invalid_request_error", "code": 400}})), False),
    (lambda g: g.fail(Reason.SHUTDOWN), False),
    (lambda g: g.feed(b"HTTP/1.0 429 Too Many Requests\r\n\r\nslow\n\n"), True),
], ids=["stray-400", "frame-400", "shutdown", "stray-429"])
def test_only_breaks_a_continuation_can_mend_are_asked_about(failure: Any, resumes: bool) -> None:
    guard, resumer = resumed_guard()
    run(guard, HEAD, [])
    step = failure(guard)
    assert bool(step.resume) is resumes
    assert step.done is not resumes
    assert resumer.decisions == []  # a yes is booked when the continuation answers


def test_the_limit_and_refused_requests_are_booked_and_end_as_today() -> None:
    guard, resumer = resumed_guard(limit=1)
    run(guard, HEAD, [])
    assert guard.fail(Reason.STREAM_CUT).resume == "stream_cut"
    guard.resume(resumer.started().rewrite)
    run(guard, chunk(SECOND, {"content": " on"}), [])
    step = guard.end_of_stream()
    assert step.done
    assert step.reason == "stream_cut"
    assert b'"code":"stream_cut"' in step.data
    # The continuation itself broke: booked once, `failed`; the limit sends no other, so no `refused`.
    assert resumer.decisions == [("stream_cut", "failed")]
    assert "limit" in (resumer.refusal or "")

    guard, resumer = resumed_guard(request={**CHAT_REQUEST, "tools": [{"type": "function"}]})
    run(guard, HEAD, [])
    assert guard.fail(Reason.STREAM_CUT).done
    assert resumer.decisions == [("stream_cut", "refused")]
    assert "tools" in (resumer.refusal or "")


def test_each_continuation_is_booked_once_by_what_came_of_it() -> None:
    """`resumed` when it carried the stream on, `failed` when it broke or errored."""
    guard, resumer = resumed_guard(limit=2)
    run(guard, HEAD, [])
    assert guard.fail(Reason.STREAM_CUT).resume == "stream_cut"
    guard.resume(resumer.started().rewrite)
    assert resumer.decisions == [("stream_cut", "resumed")]  # streaming: it carries the stream on so far
    run(guard, chunk(SECOND, {"content": " on"}), [])
    assert guard.fail(Reason.STALL_TIMEOUT).resume == "stall_timeout"
    assert resumer.decisions == [("stream_cut", "failed")]  # it broke in turn
    guard.resume(resumer.started().rewrite)
    run(guard, chunk(SECOND, {"content": " the"}), [])
    assert guard.feed(data({"error": {"message": "bad", "type": "invalid_request_error", "code": 400}})).done
    assert resumer.decisions == [("stream_cut", "failed"), ("stall_timeout", "failed")]  # it errored
    guard, resumer = resumed_guard(limit=2)
    run(guard, HEAD, [])
    assert guard.fail(Reason.STREAM_CUT).resume
    guard.resume(resumer.started().rewrite)
    run(guard, chunk(SECOND, {"content": " on"}) + chunk(SECOND, {}, "stop") + DONE, [])
    assert resumer.decisions == [("stream_cut", "resumed")]


def test_a_failed_continuation_counts_and_a_break_before_the_commit_is_never_resumed() -> None:
    guard, resumer = resumed_guard()
    run(guard, HEAD, [])
    assert guard.fail(Reason.STREAM_CUT).resume
    resumer.failed("503 from the continuation")
    assert guard.give_up().done
    assert resumer.decisions == [("stream_cut", "failed")]
    guard, resumer = resumed_guard()
    step = guard.feed(chunk(FIRST, ROLE))
    step = guard.fail(Reason.STREAM_CUT)
    assert step.failure is not None
    assert step.failure.status == 502
    assert resumer.decisions == []


def test_a_committed_stream_without_content_is_not_asked_about() -> None:
    resumer = Resumer("chat_completions", orjson.dumps(CHAT_REQUEST), 2)
    guard = StreamGuard(DIALECTS["chat_completions"], hold=False, may_resume=resumer.may_resume)
    resumer.watch(guard.stream)
    assert guard.feed(chunk(FIRST, ROLE)).commit
    step = guard.fail(Reason.STREAM_CUT)
    assert step.done
    assert b'"code":"stream_cut"' in step.data
    assert resumer.decisions == []


# ---- Retry-After, and the seam anywhere -----------------------------------------------------------------


@pytest.mark.parametrize(("value", "cap", "expected"), [
    (None, 10, 0.0), ("", 10, 0.0), ("2", 10, 2.0), ("0.5", 10, 0.5), ("-3", 10, 0.0), ("11", 10, None),
    ("soon", 10, 0.0), ("nan", 10, 0.0), ("Thu, 01 Jan 1970 00:00:05 GMT", 10, 5.0),
    ("Thu, 01 Jan 1970 00:01:00 GMT", 10, None),
])
def test_retry_after_is_waited_up_to_the_cap(value: str | None, cap: float, expected: float | None) -> None:
    assert retry_delay(value, cap, now=0.0) == expected


@settings(max_examples=80, deadline=None)
@given(st.lists(st.text(alphabet="ab \n", min_size=1, max_size=3), min_size=2, max_size=12), st.data(),
       st.booleans())
def test_the_seam_can_be_anywhere(words: list[str], data: st.DataObject, echo: bool) -> None:
    """Any answer cut after any token and continued (echoing or not) reads as the uncut answer."""
    assume(len(words) > 2 or not echo)
    cut = data.draw(st.integers(min_value=2 if echo else 1, max_value=len(words) - 1))
    n = len(words)
    prefix = "".join(words[:cut])
    # One new token that repeats the whole answer so far (two chunks or more) reads as an echo: the
    # stitcher's one documented guess (proxy/core/resume/stitch.py); no model writes it.
    assume(echo or cut < 2 or not words[cut].startswith(prefix))
    uncut = (chunk(FIRST, ROLE) + b"".join(chunk(FIRST, {"content": w}) for w in words)
             + chunk(FIRST, {}, "length") + usage(FIRST, 9, n) + DONE)
    head = chunk(FIRST, ROLE) + b"".join(chunk(FIRST, {"content": w}) for w in words[:cut])
    rest = words[cut:]
    first = "".join(words[:cut]) + rest[0] if echo else rest[0]
    cont = (chunk(SECOND, {"role": "assistant", "content": ""}) + chunk(SECOND, {"content": first})
            + b"".join(chunk(SECOND, {"content": w}) for w in rest[1:])
            + chunk(SECOND, {}, "length") + usage(SECOND, 9 + cut, n - cut) + DONE)
    guard, resumer = resumed_guard(limit=1, request={**CHAT_REQUEST, "max_tokens": n})
    written, _ = run(guard, head, [])
    step = guard.end_of_stream()
    assert step.resume == "stream_cut"
    body = orjson.loads(resumer.body())
    assert body["messages"][-1]["content"] == "".join(words[:cut])
    assert body["max_tokens"] == n - cut
    guard.resume(resumer.started().rewrite)
    rest_written, step = run(guard, cont, [])
    assert step.done
    assert step.outcome == "ok"
    assert objects(written + rest_written) == objects(uncut)


def test_a_second_failure_while_a_continuation_is_awaited_ends_the_stream() -> None:
    """(A timer that fires again before the shell carried out the first `resume`.)"""
    guard, resumer = resumed_guard()
    run(guard, HEAD, [])
    assert guard.fail(Reason.STREAM_CUT).resume == "stream_cut"
    step = guard.fail(Reason.STALL_TIMEOUT)
    assert step.done
    assert step.reason == "stall_timeout"
    assert resumer.decisions == []  # asked once; the answer never came


def test_a_one_prompt_list_and_an_absent_budget_are_continued_as_given() -> None:
    head = text_chunk(FIRST, " upon") + text_chunk(FIRST, " a")
    body = orjson.loads(continuation_body("completions", {"stream": True, "prompt": ["Once"]}, transcript_of(head)))
    assert body == {"stream": True, "prompt": "Once upon a"}  # no max_tokens invented
    ids = text_chunk(FIRST, " upon", token_ids=[11]) + text_chunk(FIRST, " a", token_ids=[12])
    body = orjson.loads(continuation_body("completions", {"stream": True, "prompt": [[1, 5]]}, transcript_of(ids)))
    assert body["prompt"] == [1, 5, 11, 12]  # a token prompt without the backend's prompt ids: its own


# ---- counting tokens, not text chunks --------------------------------


def vllm_head(pieces: list[str]) -> bytes:
    """vLLM's chat stream shape: a role chunk with `"content": ""`, then one chunk per token, `""` for a
    token that ends inside a multi-byte character (its detokenizer holds the bytes back)."""
    role = chunk(FIRST, {"role": "assistant", "content": ""})
    return role + b"".join(chunk(FIRST, {"content": p}, token_ids=None) for p in pieces)


def test_vllms_empty_deltas_count_as_the_tokens_they_are() -> None:
    """A cut seen against vLLM: 22 tokens streamed, 17 of them empty chunks, for max_tokens 64: the
    continuation asks 42 (it asked 59), and the client's usage is the original prompt's and 22 + 42."""
    pieces = ["\ufffdWh", "", "", "", " a", "", "", "", "", "y", "", "", "", "", "", "", "", "b", "", "", "", "c"]
    assert (len(pieces), pieces.count("")) == (22, 17)
    request = {**CHAT_REQUEST, "max_tokens": 64}
    transcript = transcript_of(vllm_head(pieces))
    assert transcript.produced == 22
    body = orjson.loads(continuation_body("chat_completions", request, transcript))
    assert body["max_tokens"] == 42
    # an empty finish chunk (vLLM's abort, completions' last chunk) is no token
    assert transcript_of(vllm_head(["a", ""]) + chunk(FIRST, {"content": ""}, "abort")).produced == 2


def test_upstream_usage_numbers_are_validated() -> None:
    """A negative per-chunk completion_tokens raised one continuation's max_tokens from 20 to 1,000,020."""
    request = {**CHAT_REQUEST, "max_tokens": 40}
    def with_usage(completion: int, prompt: int = 9) -> dict[str, Any]:
        return {"usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}}
    good = b"".join(data({**FIRST, "object": "chat.completion.chunk", **with_usage(i + 2),
                          "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]})
                    for i, w in enumerate(WORDS[:3]))  # two tokens a chunk, as usage says
    transcript = transcript_of(good)
    assert transcript.produced == 4
    assert transcript.prompt_tokens == 9
    hostile = good + data({**FIRST, "object": "chat.completion.chunk", **with_usage(-1_000_000),
                           "choices": [{"index": 0, "delta": {"content": " x"}, "finish_reason": None}]})
    transcript = transcript_of(hostile)
    assert transcript.produced == 4  # the chunks (the last usage is ignored, and so is every later one)
    body = orjson.loads(continuation_body("chat_completions", request, transcript))
    assert body["max_tokens"] == 36
    # the continuation's usage: prompt_tokens the original prompt's, completion the sum, whatever the seam
    cont = usage(SECOND, 9 + 7, 5)  # (the continuation's prompt re-tokenized the text so far as 7)
    rest = stitched(transcript_of(good), cont)
    assert rest[0]["usage"] == {"prompt_tokens": 9, "completion_tokens": 4 + 5, "total_tokens": 18}
    bad = stitched(transcript_of(good), usage(SECOND, 9, -3))
    assert bad[0]["usage"]["completion_tokens"] == -3  # not a count: passed as it came, never added to


# ---- what a resumable exchange holds --------------------------------------------


def test_a_resumer_holds_the_clients_bytes_not_their_parsed_objects() -> None:
    """An 8 MB body of small objects was ~150 MiB of Python objects, held for the whole stream."""
    import gc
    import tracemalloc

    request = {**CHAT_REQUEST, "messages": [{"role": "user", "content": f"m{i}", "name": "u"} for i in range(20_000)]}
    body = orjson.dumps(request)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        resumer = Resumer("chat_completions", body, 1)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert resumer.possible
    assert held < len(body) // 2  # (the parsed request is ~10 times the bytes; the bytes are the caller's)
    guard = StreamGuard(DIALECTS["chat_completions"], hold=True, may_resume=resumer.may_resume)
    resumer.watch(guard.stream)
    run(guard, HEAD, [])
    assert guard.fail(Reason.STREAM_CUT).resume
    sent = orjson.loads(resumer.body())  # parsed again, now that a continuation is due
    assert sent["messages"][:-1] == request["messages"]


# ---- the continuation keeps the client's bytes ----------------------------------


def cut_resumer(raw: bytes, max_size: int | None = None, head: bytes = HEAD) -> tuple[StreamGuard, Resumer]:
    resumer = Resumer("chat_completions", raw, 2, max_size)
    guard = StreamGuard(DIALECTS["chat_completions"], hold=True, may_resume=resumer.may_resume)
    resumer.watch(guard.stream)
    run(guard, head, [])
    return guard, resumer


def test_the_continuation_keeps_every_unchanged_field_as_the_client_wrote_it() -> None:
    """A 30-digit integer became a float and duplicate keys collapsed when the body was re-serialized."""
    raw = (b'{ "model" : "m", "stream":true, "seed": 123456789012345678901234567890,\n'
           b' "logit_bias": {"5": -1, "5": -2}, "max_tokens": 6, "max_tokens": 9,\n'
           b' "messages": [ {"role": "user", "content": "Say \\u00e9 it."} ] , "x": [1.50, 1e3] }')
    guard, resumer = cut_resumer(raw)
    assert guard.fail(Reason.STREAM_CUT).resume
    sent = resumer.body()
    assert b'"seed": 123456789012345678901234567890,' in sent
    assert b'"logit_bias": {"5": -1, "5": -2}' in sent
    assert b'"content": "Say \\u00e9 it."}' in sent
    assert b'"x": [1.50, 1e3]' in sent
    assert sent.count(b'"max_tokens": 6') == 2  # 9 - 3, wherever the key occurs (a backend reads the last)
    body = orjson.loads(sent)
    assert body["messages"][-1] == {"role": "assistant", "content": SO_FAR}
    assert (body["continue_final_message"], body["add_generation_prompt"]) == (True, False)
    # a client prefill is continued in place, its other bytes kept
    raw = (b'{"stream":true,"continue_final_message":true,"add_generation_prompt":false,"messages":'
           b'[{"role":"user","content":"a"},{"content":"Once","role":"assistant","n":1e2}],"max_tokens":8}')
    guard, resumer = cut_resumer(raw)
    assert guard.fail(Reason.STREAM_CUT).resume
    sent = resumer.body()
    assert b'{"content":"Once' + SO_FAR.encode() + b'","role":"assistant","n":1e2}]' in sent
    assert orjson.loads(sent)["max_tokens"] == 5


def test_no_continuation_is_sent_past_the_body_limit() -> None:
    """A 100 MB transcript made an 85 MB continuation past --max-body-size: refused instead, booked so."""
    raw = orjson.dumps(CHAT_REQUEST)
    guard, resumer = cut_resumer(raw, max_size=len(raw) + 20)
    assert not guard.fail(Reason.STREAM_CUT).resume
    assert resumer.decisions == [("stream_cut", "refused")]
    assert "--max-body-size" in (resumer.refusal or "")
    guard, resumer = cut_resumer(raw, max_size=len(raw) + 200)
    assert guard.fail(Reason.STREAM_CUT).resume
    assert len(resumer.body()) <= len(raw) + 200


@pytest.mark.parametrize("api", ["chat_completions", "completions"])
def test_an_answer_past_the_body_limit_is_no_longer_recorded(api: str) -> None:
    """A 100 MB answer was kept whole (HWM 415-463 MiB against 45) though no continuation can carry
    more than --max-body-size: past it nothing more is kept, the stream records no more (its quick
    paths return), and a later cut ends as without the flag, the refusal saying why."""
    limit = 1000
    if api == "chat_completions":
        raw, make = orjson.dumps(CHAT_REQUEST), chunk
        head = chunk(FIRST, ROLE)
    else:
        raw, make, head = orjson.dumps({"model": "m", "stream": True, "prompt": "Say it."}), text_chunk, b""
    resumer = Resumer(api, raw, 2, limit)
    guard = StreamGuard(DIALECTS[api], hold=True, may_resume=resumer.may_resume)
    resumer.watch(guard.stream)
    word = "abcdefghi "  # 10 characters a chunk, each with its token ids (a completions continuation's other way)
    run(guard, head + b"".join(make(FIRST, word, token_ids=[1000 + i]) if api == "completions"
                              else make(FIRST, {"content": word}, token_ids=[1000 + i]) for i in range(90)), [])
    assert len(resumer.transcript.text) == 900  # (under the limit: kept)
    assert guard.stream.recorder is not None  # type: ignore[attr-defined]
    more = b"".join(make(FIRST, word, token_ids=[7]) if api == "completions"
                    else make(FIRST, {"content": word}, token_ids=[7]) for _ in range(500))
    run(guard, more, [])
    transcript = resumer.transcript
    assert transcript.overflowed
    assert (transcript.text, transcript.token_ids) == ("", [])
    assert guard.stream.recorder is None  # type: ignore[attr-defined]
    step = guard.fail(Reason.STREAM_CUT)
    assert step.done
    assert not step.resume
    assert step.reason == "stream_cut"
    assert resumer.decisions == [("stream_cut", "refused")]
    assert "passed --max-body-size" in (resumer.refusal or "")


def test_token_ids_past_the_body_limit_are_dropped_and_the_text_continued() -> None:
    """Ids no body could carry (a digit and a comma each) are not kept; the text, under the limit, is."""
    resumer = Resumer("chat_completions", orjson.dumps(CHAT_REQUEST), 2, 1000)
    guard = StreamGuard(DIALECTS["chat_completions"], hold=True, may_resume=resumer.may_resume)
    resumer.watch(guard.stream)
    run(guard, chunk(FIRST, ROLE) + chunk(FIRST, {"content": "The"}, token_ids=list(range(600))), [])
    assert resumer.transcript.token_ids == []
    assert resumer.transcript.exact_tokens is None
    assert not resumer.transcript.overflowed
    assert guard.fail(Reason.STREAM_CUT).resume
    assert orjson.loads(resumer.body())["messages"][-1] == {"role": "assistant", "content": "The"}


def test_the_transcript_joins_its_parts_as_it_goes() -> None:
    """Small text parts are joined every so often: a list of 3-character strings is ~20 times its text."""
    transcript = Transcript()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(100_000):
            transcript.note({"choices": [{"index": 0, "delta": {"content": f"a{i % 10} "}}]})  # (a new string each)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 4 * 300_000, held  # (kept part by part: 6 MB)
    assert transcript.text == "".join(f"a{i % 10} " for i in range(100_000))


def test_a_resumer_takes_the_handlers_parse_and_refuses_a_body_not_parsed() -> None:
    """The request is parsed once (the handler's parse is handed over); a body the handler did not
    parse (compressed, or costly to parse) is refused, not parsed here."""
    body = orjson.dumps(CHAT_REQUEST)
    assert Resumer("chat_completions", body, 1, request=orjson.loads(body)).possible
    unparsed = Resumer("chat_completions", body, 1, request=None)
    assert not unparsed.possible
    assert unparsed.refusal is not None
    assert "not parsed" in unparsed.refusal
    assert not Resumer("chat_completions", body, 1, request=[1]).possible
