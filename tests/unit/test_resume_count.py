"""Counting the answer so far with the backend's tokenizer (sans-IO): when it is asked, what its answer
means, and what the continuation and its usage make of it."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.core.dialects import DIALECTS
from proxy.core.guard import StreamGuard
from proxy.core.resume import Refusal, Resumer, Stitcher
from proxy.core.resume.count import answer_limit, read_count, tokenize_body
from proxy.core.sse import Event
from proxy.core.verdicts import Reason

BATCHED = ["The cat sat", " on the mat", " and the dog"]  # three tokens a chunk, nine in all
SO_FAR = "".join(BATCHED)


def data(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chunk(delta: dict[str, Any], **extra: Any) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": None, **extra}
    return data({"id": "c1", "created": 1, "model": "m", "object": "chat.completion.chunk", "choices": [choice]})


def request(**fields: Any) -> bytes:
    return orjson.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "Hi"}], **fields})


def cut(body: bytes, stream: bytes) -> Resumer:
    """A resumer whose stream carried `stream` and then was cut (asked, and answered yes)."""
    resumer = Resumer("chat_completions", body, 2)
    guard = StreamGuard(DIALECTS["chat_completions"], hold=False, may_resume=resumer.may_resume)
    resumer.watch(guard.stream)
    guard.feed(stream)
    assert guard.fail(Reason.STREAM_CUT).resume == "stream_cut"
    return resumer


HEAD = chunk({"role": "assistant", "content": ""}) + b"".join(chunk({"content": t}) for t in BATCHED)


def test_a_batched_stream_without_a_count_asks_the_tokenizer() -> None:
    resumer = cut(request(max_tokens=30), HEAD)
    need = resumer.count_request()
    assert need is not None
    body, limit = need
    assert orjson.loads(body) == {"model": "m", "prompt": SO_FAR, "add_special_tokens": False,
                                  "return_token_strs": True, "content": SO_FAR, "add_special": False,
                                  "with_pieces": True}
    assert limit == answer_limit(SO_FAR)
    assert orjson.loads(resumer.body())["max_tokens"] == 27  # (before the count: by chunks, a lower bound)
    assert resumer.counted(200, b'{"count": 9, "max_model_len": 4096, "tokens": [1,2,3,4,5,6,7,8,9]}')
    assert orjson.loads(resumer.body())["max_tokens"] == 21
    assert resumer.transcript.produced == 9


def test_usage_after_the_count_moves_the_tokenized_text_out_of_the_prompt() -> None:
    """The continuation's prompt holds the text as the backend tokenizes it (here 11 tokens, for 9
    that wrote it): those leave the prompt, the 9 join the completion."""
    resumer = cut(request(max_tokens=30, stream_options={"include_usage": True}), HEAD)
    assert resumer.counted(200, b'{"count": 11}')
    stitcher: Stitcher = resumer.started()
    assert resumer.transcript.produced == 11  # (the larger of the tokenizer's count and the chunks)
    usage = {"prompt_tokens": 5 + 11, "completion_tokens": 19, "total_tokens": 35}
    payload = orjson.dumps({"id": "c2", "object": "chat.completion.chunk", "choices": [], "usage": usage})
    out = stitcher.rewrite(Event(raw=b"data: " + payload + b"\n\n", data=payload, has_data=True))
    assert out is not None
    assert orjson.loads(out.data)["usage"] == {"prompt_tokens": 5, "completion_tokens": 30, "total_tokens": 35}


@pytest.mark.parametrize(
    ("stream", "fields"),
    [
        # per-chunk usage (vLLM's continuous_usage_stats) says the count
        (HEAD.replace(b'"finish_reason":null}]', b'"finish_reason":null}],"usage":{"prompt_tokens":5,'
                      b'"completion_tokens":9,"total_tokens":14}'), {"max_tokens": 30}),
        # token ids say it
        (chunk({"role": "assistant", "content": ""}) + b"".join(
            chunk({"content": t}, token_ids=[1, 2, 3]) for t in BATCHED), {"max_tokens": 30}),
        # no budget, no usage asked: no count changes anything
        (HEAD, {}),
    ],
)
def test_no_tokenizer_is_asked_when_the_stream_says_or_nothing_depends_on_it(
    stream: bytes, fields: dict[str, Any]
) -> None:
    assert cut(request(**fields), stream).count_request() is None


@pytest.mark.parametrize(
    ("status", "answer", "why"),
    [
        (404, b'{"detail": "Not Found"}', "status 404"),
        (200, b"<html>", "no JSON"),
        (200, b"[1, 2]", "no JSON object"),
        (200, b'{"count": -5, "tokens": []}', "is not a count"),
        (200, b'{"count": 3, "tokens": [1, 2]}', "is not a count"),
        (200, b'{"count": "9"}', "is not a count"),
        (200, b'{"tokens": ["a"]}', "are not token ids"),
        (200, b'{"tokens": []}', "counted no tokens"),  # (llama-server without `content`)
        (200, b'{"count": 1000000}', "counted 1000000 tokens in"),
    ],
)
def test_an_answer_that_is_no_count_is_a_refusal(status: int, answer: bytes, why: str) -> None:
    with pytest.raises(Refusal, match=why):
        read_count(status, answer, SO_FAR)
    resumer = cut(request(max_tokens=30), HEAD)
    assert not resumer.counted(status, answer)
    assert resumer.decisions == [("stream_cut", "refused")]
    assert resumer.refusal is not None
    assert why in resumer.refusal


def test_both_shapes_of_answer_are_read() -> None:
    assert read_count(200, b'{"count": 9, "max_model_len": 4096, "tokens": [1,2,3,4,5,6,7,8,9]}', SO_FAR) == 9
    assert read_count(200, b'{"tokens": [1,2,3,4,5,6,7,8,9]}', SO_FAR) == 9  # llama-server
    assert orjson.loads(tokenize_body(None, "x")) == {"prompt": "x", "add_special_tokens": False,
                                                       "return_token_strs": True, "content": "x",
                                                       "add_special": False, "with_pieces": True}
    # llama-server's pieces (text, or bytes where a token is not UTF-8)
    pieces = b'{"tokens": [{"id": 5, "piece": "The"}, {"id": 6, "piece": [226, 150]}]}'
    assert read_count(200, pieces, "The\u00e9") == 2


@pytest.mark.parametrize(
    "answer",
    [
        b'{"tokens": [{"id": 29871, "piece": " "}, {"id": 7, "piece": "a"}, {"id": 8, "piece": "b"}]}',
        '{"count": 3, "tokens": [29871, 7, 8], "token_strs": ["\u2581", "a", "b"]}'.encode(),
    ],
)
def test_a_sentencepiece_dummy_prefix_is_not_counted(answer: bytes) -> None:
    """SentencePiece tokenizes "ab" as "▁", "a", "b": the space was never written (llama-server's
    single-character test model would otherwise be counted one token too many at every cut)."""
    assert read_count(200, answer, "ab") == 2
    assert read_count(200, answer, " ab") == 3  # (a text that starts with a space has it)


def test_a_count_that_uses_the_budget_up_is_refused() -> None:
    resumer = cut(request(max_tokens=10), HEAD)
    assert not resumer.counted(200, b'{"count": 10}')
    assert resumer.refusal == "the answer had used its `max_tokens` already"
    assert resumer.decisions == [("stream_cut", "refused")]


def test_the_unanswered_tokenizer_is_booked_refused() -> None:
    resumer = cut(request(max_tokens=30), HEAD)
    resumer.uncounted("no tokenizer to count the answer so far: /tokenize did not answer within 2 s")
    assert resumer.decisions == [("stream_cut", "refused")]


@pytest.mark.parametrize("min_tokens", [None, 5])
def test_without_a_budget_no_count_is_no_refusal_and_the_usage_is_estimated(min_tokens: int | None) -> None:
    """Only the usage asked for needs the count: without it the continuation goes, on the chunks' count
    (it asks no budget either), and the usage is marked estimated; `min_tokens` is a budget to lower."""
    fields: dict[str, Any] = {"stream_options": {"include_usage": True}}
    if min_tokens is not None:
        fields["min_tokens"] = min_tokens
    resumer = cut(request(**fields), HEAD)
    assert resumer.count_request() is not None  # (asked: a count would make the usage exact)
    if min_tokens is not None:
        assert not resumer.counted(404, b'{"detail": "Not Found"}')
        assert resumer.decisions == [("stream_cut", "refused")]
        return
    assert resumer.counted(404, b'{"detail": "Not Found"}')
    assert "max_tokens" not in orjson.loads(resumer.body())
    assert not resumer.estimated
    resumer.started()
    assert resumer.estimated
    assert resumer.decisions == [("stream_cut", "resumed")]


def test_a_counted_continuation_is_not_estimated() -> None:
    resumer = cut(request(stream_options={"include_usage": True}), HEAD)
    assert resumer.counted(200, b'{"count": 9}')
    resumer.started()
    assert not resumer.estimated
