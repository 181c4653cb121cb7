"""The parse-free path for Responses and Messages delta events gives exactly the full parse's verdicts.

Those events carry an `event:` line, and a Responses delta a `sequence_number` that changes every
event, which the proxy's own error frames continue from. The reference is the guard with a dialect that
never finds a repeat (every event through the reader and one parse); the fast path is fed whole
events, one read of them all, each event in two pieces, byte by byte, and any chunking. Streams that end without a
terminal event get the proxy's error frame, so its sequence number is compared too.
"""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.fast_path import NoFastPath, Outcome, outcome

from proxy.core.dialects import DIALECTS, Dialect, Kind
from proxy.core.dialects.messages import MessagesStream
from proxy.core.dialects.responses import ResponsesStream
from proxy.core.guard import Step, StreamGuard
from proxy.core.sse import Event


def named(name: str, payload: dict[str, Any] | bytes) -> bytes:
    data = payload if isinstance(payload, bytes) else orjson.dumps(payload)
    return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"


# ---- Responses ------------------------------------------------------------------------------------

R_DELTA = "response.output_text.delta"
R_RESPONSE = {"id": "resp_1", "object": "response", "created_at": 7, "model": "m", "status": "in_progress"}
R_CREATED = named("response.created", {"type": "response.created", "sequence_number": 0, "response": R_RESPONSE})


def r_delta(text: str, seq: int, *, order: str = "openai") -> bytes:
    if order == "openai":  # what OpenAI writes
        body: dict[str, Any] = {"type": R_DELTA, "sequence_number": seq, "item_id": "msg_1", "output_index": 0,
                                "content_index": 0, "delta": text, "logprobs": []}  # fmt: skip
    elif order == "vllm":  # pydantic's field order: the text before the number
        body = {"content_index": 0, "delta": text, "item_id": "msg_1", "logprobs": [], "output_index": 0,
                "sequence_number": seq, "type": R_DELTA}  # fmt: skip
    else:  # no sequence number at all
        body = {"type": R_DELTA, "item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": text}
    return named(R_DELTA, body)


def r_completed(seq: int) -> bytes:
    response = {**R_RESPONSE, "status": "completed", "usage": {"input_tokens": 3, "output_tokens": 9}}
    return named("response.completed", {"type": "response.completed", "sequence_number": seq, "response": response})


def _parts(order: str) -> tuple[bytes, bytes, bytes]:
    """A canonical delta's bytes around its two leaves, in their order."""
    whole = r_delta("\x00", 123456789, order=order)
    first, rest = whole.split(b"\\u0000") if order == "vllm" else whole.split(b"123456789")
    mid, tail = rest.split(b"123456789") if order == "vllm" else rest.split(b"\\u0000")
    return first, mid, tail


R_HEAD, R_MID, R_TAIL = _parts("openai")
V_HEAD, V_MID, V_TAIL = _parts("vllm")


def r_around(number: bytes, text: bytes) -> bytes:
    """An OpenAI-order delta with anything as its number and its text."""
    return R_HEAD + number + R_MID + text + R_TAIL


def v_around(text: bytes, number: bytes) -> bytes:
    """A vLLM-order delta (text first) with anything as its text and its number."""
    return V_HEAD + text + V_MID + number + V_TAIL


# ---- Messages -------------------------------------------------------------------------------------

M_START = named("message_start", {"type": "message_start", "message": {
    "id": "msg_1", "type": "message", "role": "assistant", "model": "claude", "content": [],
    "usage": {"input_tokens": 5, "output_tokens": 1}}})  # fmt: skip
M_BLOCK = named("content_block_start", {"type": "content_block_start", "index": 0,
                                        "content_block": {"type": "text", "text": ""}})  # fmt: skip
M_STOP_DELTA = named("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                       "usage": {"output_tokens": 12}})  # fmt: skip
OVERLOADED = {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
M_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


def m_delta(text: str, kind: str = "text_delta", key: str = "text", index: int = 0) -> bytes:
    return named("content_block_delta", {"type": "content_block_delta", "index": index,
                                         "delta": {"type": kind, key: text}})  # fmt: skip


M_HEAD, M_TAIL = m_delta("\x00").split(b"\\u0000")


def m_around(mid: bytes) -> bytes:
    return M_HEAD + mid + M_TAIL


# ---- the harness ----------------------------------------------------------------------------------


class ParsedResponses(NoFastPath, ResponsesStream):
    """The dialect with no fast path: every event through the reader and one parse."""


class ParsedMessages(NoFastPath, MessagesStream):
    pass


PARSED = {
    "responses": Dialect("responses", json_body=True, anthropic=False, stream_factory=ParsedResponses),
    "messages": Dialect("messages", json_body=True, anthropic=True, stream_factory=ParsedMessages),
}


def feed(chunks: list[bytes], dialect: str, *, hold: bool = False, parsed: bool = False) -> Outcome:
    guard = StreamGuard(PARSED[dialect] if parsed else DIALECTS[dialect], hold=hold)
    steps: list[Step] = [guard.feed(c) for c in chunks]
    steps.append(guard.end_of_stream())
    return outcome(guard, steps)


def reference(events: list[bytes], dialect: str, **kw: Any) -> Outcome:
    """The full parse of every event. (Not the guard fed events in two pieces: it completes a cut
    event with the template too.)"""
    return feed(events, dialect, parsed=True, **kw)


def same(events: list[bytes], dialect: str, **kw: Any) -> Outcome:
    ref = reference(events, dialect, **kw)
    assert feed(events, dialect, **kw) == ref
    assert feed([b"".join(events)], dialect, **kw) == ref
    assert feed([piece for e in events for piece in (e[:1], e[1:]) if piece], dialect, **kw) == ref
    whole = b"".join(events)
    assert feed([whole[i : i + 1] for i in range(len(whole))], dialect, **kw) == ref  # byte by byte
    return ref


class CountingResponses(ResponsesStream):
    parsed = 0

    def classify(self, event: Event) -> Kind:
        CountingResponses.parsed += 1
        return super().classify(event)


class CountingMessages(MessagesStream):
    parsed = 0

    def classify(self, event: Event) -> Kind:
        CountingMessages.parsed += 1
        return super().classify(event)


# ---- the fast path is taken, and the proxy's frames continue the numbers -----------------------------


@pytest.mark.parametrize("order", ["openai", "vllm", "none"])
def test_responses_deltas_are_recognised_without_a_parse(order: str) -> None:
    CountingResponses.parsed = 0
    dialect = Dialect("responses", json_body=True, anthropic=False, stream_factory=CountingResponses)
    guard = StreamGuard(dialect, hold=False)
    guard.feed(R_CREATED + r_delta("Hello", 1, order=order))
    assert CountingResponses.parsed == 2
    run = b"".join(r_delta(f" w{i}", i, order=order) for i in range(2, 40))
    step = guard.feed(run)
    assert (step.data, step.content_events) == (run, 38)
    assert CountingResponses.parsed == 2  # not one of them parsed
    end = guard.end_of_stream()  # no response.completed: the proxy's ending continues the numbers
    assert end.reason == "stream_cut"
    frames = [orjson.loads(line[6:]) for line in end.data.split(b"\n") if line.startswith(b"data: ")]
    if order == "none":
        assert [f["sequence_number"] for f in frames] == [1, 2]
    else:
        assert [f["sequence_number"] for f in frames] == [40, 41]
    assert end.data == reference([R_CREATED, r_delta("Hello", 1, order=order), run], "responses").data[-len(end.data):]


def test_messages_deltas_are_recognised_without_a_parse() -> None:
    CountingMessages.parsed = 0
    dialect = Dialect("messages", json_body=True, anthropic=True, stream_factory=CountingMessages)
    guard = StreamGuard(dialect, hold=False)
    guard.feed(M_START + M_BLOCK + m_delta("Hello"))
    run = b"".join(m_delta(f" w{i}") for i in range(40))
    step = guard.feed(run)
    assert (step.data, step.content_events, CountingMessages.parsed) == (run, 40, 3)


def test_normal_streams_are_byte_identical_on_both_paths() -> None:
    for order in ("openai", "vllm", "none"):
        events = [R_CREATED, *(r_delta(f" w{i}", i, order=order) for i in range(1, 30)), r_completed(30)]
        ref = same(events, "responses")
        assert (ref.data, ref.reason, ref.content_events) == (b"".join(events), "complete", 29)
    events = [M_START, M_BLOCK, *(m_delta(f" w{i}") for i in range(30)), M_STOP_DELTA, M_STOP]
    ref = same(events, "messages")
    assert (ref.data, ref.reason, ref.content_events) == (b"".join(events), "complete", 30)


# ---- what looks like a repeat but is not ------------------------------------------------------------

TEXTS = [
    b"",  # empty: not content
    b'x","type":"error',  # a quote ends the string early
    b"\\ud800",  # a lone surrogate: malformed
    b"\\ud83d\\ude00",  # a valid pair: judged by the parser
    b"\\u0041",
    b"\xff\xfe",  # not UTF-8
    b"\xed\xa0\x80",
    b"\xc3",
    "héllo 日本".encode(),
    b"a\x01b",
    b"a\\",
    b"a\\\\",
    b"\\/\\\"\\b\\f\\n\\r\\t",
    b"\\x",
    b"a\nb",  # a line break inside the data line
]
NUMBERS = [
    b"5", b"0", b"-1", b"-0", b"05", b"5.0", b"1e3", b"123456789012345678", b"1234567890123456789",
    b"99999999999999999999", b'"5"', b"true", b"null", b"", b" 5", b"5 ", b"3,\"x\":1",
]  # fmt: skip


@pytest.mark.parametrize("text", TEXTS)
def test_responses_look_alike_texts_get_the_full_parse_verdict(text: bytes) -> None:
    same([R_CREATED, r_delta("a", 1), r_around(b"2", text), r_delta("b", 3)], "responses")
    same([R_CREATED, r_delta("a", 1, order="vllm"), v_around(text, b"2"), r_delta("b", 3, order="vllm")], "responses")


@pytest.mark.parametrize("number", NUMBERS)
def test_responses_look_alike_numbers_get_the_full_parse_verdict(number: bytes) -> None:
    same([R_CREATED, r_delta("a", 1), r_around(number, b"x"), r_delta("b", 2)], "responses")
    same([R_CREATED, r_delta("a", 1, order="vllm"), v_around(b"x", number), r_delta("b", 2, order="vllm")],
         "responses")  # fmt: skip


@pytest.mark.parametrize("text", TEXTS)
def test_messages_look_alike_texts_get_the_full_parse_verdict(text: bytes) -> None:
    same([M_START, M_BLOCK, m_delta("a"), m_around(text), m_delta("b"), M_STOP_DELTA], "messages")


@pytest.mark.parametrize(
    "events",
    [
        # numbers going down, repeating, jumping: the proxy's ending continues from the largest
        [R_CREATED, r_delta("a", 5), r_delta("b", 3), r_delta("c", 9), r_delta("d", 2)],
        [R_CREATED, r_delta("a", 5), r_delta("b", 5), r_delta("c", 10**17)],
        [R_CREATED, r_delta("a", 1), r_delta("b", 2**63 - 1), r_delta("c", 2)],
        [R_CREATED, r_delta("a", 1), r_around(b"%d" % 2**64, b"b")],  # orjson refuses it: malformed
        # another field order, another type, another event line, an error: never a repeat
        [R_CREATED, r_delta("a", 1), r_delta("b", 2, order="vllm"), r_delta("c", 3)],
        [R_CREATED, r_delta("a", 1), r_delta("b", 2).replace(b"output_text", b"refusal"), r_delta("c", 3)],
        [R_CREATED, r_delta("a", 1), r_delta("b", 2).replace(b"event: response.output_text.delta", b"event: error"),
         r_delta("c", 3)],
        [R_CREATED, r_delta("a", 1), r_delta("b", 2).replace(b"event: ", b"event:"), r_delta("c", 3)],
        [R_CREATED, r_delta("a", 1), r_delta("b", 2).split(b"\n", 1)[1], r_delta("c", 3)],
        [R_CREATED, r_delta("a", 1), b"id: 4\n" + r_delta("b", 2), r_delta("c", 3)],
        [R_CREATED, r_delta("a", 1), r_delta("b", 2).replace(b"\n", b"\r\n"), r_delta("c", 3)],
        [R_CREATED, r_delta("a", 1), r_delta("b", 2) + named("error", {"type": "error", "sequence_number": 3,
                                                                        "code": "x", "message": "boom"})],
        [R_CREATED, r_delta("a", 1), r_delta("b", 2) + b"HTTP/1.1 500 Oops\r\n\r\n{}"],
        [R_CREATED, r_delta("a", 1), r_delta("b", 2), r_completed(3), r_delta("c", 4)],
        # a sequence number that is no int: never a template
        [R_CREATED, *(named(R_DELTA, {"type": R_DELTA, "sequence_number": f"{i}", "delta": "x"}) for i in range(4))],
        [R_CREATED, *(named(R_DELTA, {"type": R_DELTA, "sequence_number": -i, "delta": "x"}) for i in range(4))],
        [R_CREATED, *(named(R_DELTA, {"type": R_DELTA, "sequence_number": 1, "delta": "x", "x": "x"})
                      for _ in range(4))],  # the marker's neighbours
        # the same object, other spelling: parsed every time
        [R_CREATED, *(named(R_DELTA, b'{"type": "%s", "sequence_number": %d, "delta": "x"}' % (R_DELTA.encode(), i))
                      for i in range(1, 5))],
        # a partial event pending in the reader
        [R_CREATED, r_delta("a", 1), r_delta("b", 2)[:-1], r_delta("c", 3), r_delta("d", 4)],
        [R_CREATED, r_delta("a", 1), b"event: x\ndata: {oops", r_delta("c", 3), r_delta("d", 4)],
    ],
)
def test_responses_mixed_streams_get_the_full_parse_verdict(events: list[bytes]) -> None:
    for hold in (False, True):
        same(events, "responses", hold=hold)


@pytest.mark.parametrize(
    "events",
    [
        [M_START, M_BLOCK, m_delta("a"), m_delta("b", "thinking_delta", "thinking"), m_delta("c")],
        [M_START, M_BLOCK, *(m_delta(f'{{"k":{i}', "input_json_delta", "partial_json") for i in range(4))],
        [M_START, M_BLOCK, m_delta("a"), m_delta("b", index=1), m_delta("c")],
        [M_START, M_BLOCK, m_delta("a"), m_delta("b").replace(b"event: content_block_delta", b"event: error")],
        [M_START, M_BLOCK, m_delta("a"), m_delta("b").split(b"\n", 1)[1], m_delta("c"), M_STOP_DELTA],
        [M_START, M_BLOCK, m_delta("a"), m_delta("b").replace(b"event: ", b"event:"), m_delta("c")],
        [M_START, M_BLOCK, m_delta("a"), m_delta("b") + M_STOP_DELTA + M_STOP],
        [M_START, M_BLOCK, m_delta("a"), m_delta("b") + named("error", OVERLOADED)],
        [M_START, M_BLOCK, m_delta("a"), m_delta("b") + b"data: " + orjson.dumps(OVERLOADED) + b"\n\n"],
        [M_START, M_BLOCK, *(named("content_block_delta", b'{"type": "content_block_delta", "index": 0, '
                                   b'"delta": {"type": "text_delta", "text": "%d"}}' % i) for i in range(4))],
        [M_START, M_BLOCK, *(named("content_block_delta", {"delta": {"text": f"{i}", "type": "text_delta"},
                                                          "index": 0, "type": "content_block_delta"})
                             for i in range(4))],  # another field order
        [M_START, M_BLOCK, m_delta("a"), m_delta("b").replace(b"\n", b"\r\n"), m_delta("c")],
        [M_START, M_BLOCK, m_delta("a"), m_delta("b")[:-1], m_delta("c"), M_STOP_DELTA],
    ],
)
def test_messages_mixed_streams_get_the_full_parse_verdict(events: list[bytes]) -> None:
    for hold in (False, True):
        same(events, "messages", hold=hold)


# ---- property: any mix, any chunking ------------------------------------------------------------------

R_ITEM_DONE = named("response.output_item.done", {"type": "response.output_item.done", "sequence_number": 77})
_r_pieces = st.one_of(
    st.tuples(st.text(max_size=6), st.integers(0, 2**40)).map(lambda t: r_delta(t[0], t[1])),
    st.tuples(st.binary(max_size=6), st.sampled_from(NUMBERS)).map(lambda t: r_around(t[1], t[0])),
    st.tuples(st.sampled_from(TEXTS), st.integers(0, 50)).map(lambda t: r_around(b"%d" % t[1], t[0])),
    st.tuples(st.text(max_size=6), st.integers(0, 50)).map(lambda t: r_delta(t[0], t[1], order="vllm")),
    st.sampled_from([r_completed(99), b": ping\n\n", R_ITEM_DONE]),
)
_m_pieces = st.one_of(
    st.text(max_size=6).map(m_delta),
    st.binary(max_size=6).map(m_around),
    st.sampled_from(TEXTS).map(m_around),
    st.sampled_from([M_STOP_DELTA, M_STOP, b": ping\n\n", m_delta("x", "thinking_delta", "thinking")]),
)


def _chunked(events: list[bytes], cuts: list[int]) -> list[bytes]:
    whole = b"".join(events)
    bounds = sorted({0, len(whole), *(c for c in cuts if c < len(whole))})
    return [whole[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=200, deadline=None)
@given(st.lists(_r_pieces, max_size=12), st.lists(st.integers(0, 3000), max_size=6), st.booleans())
def test_any_responses_stream_any_chunking_matches_the_full_parse(
    events: list[bytes], cuts: list[int], hold: bool
) -> None:
    events = [R_CREATED, r_delta("first", 1), *events]
    ref = reference(events, "responses", hold=hold)
    assert feed(events, "responses", hold=hold) == ref
    assert feed(_chunked(events, cuts), "responses", hold=hold) == ref


@settings(max_examples=200, deadline=None)
@given(st.lists(_m_pieces, max_size=12), st.lists(st.integers(0, 3000), max_size=6), st.booleans())
def test_any_messages_stream_any_chunking_matches_the_full_parse(
    events: list[bytes], cuts: list[int], hold: bool
) -> None:
    events = [M_START, M_BLOCK, m_delta("first"), *events]
    ref = reference(events, "messages", hold=hold)
    assert feed(events, "messages", hold=hold) == ref
    assert feed(_chunked(events, cuts), "messages", hold=hold) == ref
