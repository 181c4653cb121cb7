"""The guard's parse-free path for repeated content events gives exactly the verdicts of the full parse.

The reference is the guard with a chat dialect that never finds a repeat: every event goes through
the SSE reader, one JSON parse and the dialect's classification. (Not the guard fed each event in
two pieces: it completes an event a read cut with the template too; that is one more way the fast
path is fed, as are whole events and whole runs of events in one chunk.)
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
from proxy.core.dialects.chat import ChatStream
from proxy.core.dialects.repeat import ContentTemplate
from proxy.core.guard import GuardState, Step, StreamGuard
from proxy.core.lifecycle import Reason
from proxy.core.sse import Event

BASE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def obj(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta if delta is not None else {}, "logprobs": None, "finish_reason": finish}
    return {**BASE, "choices": [choice], **extra}


def event(payload: dict[str, Any] | bytes) -> bytes:
    return b"data: " + (payload if isinstance(payload, bytes) else orjson.dumps(payload)) + b"\n\n"


def content(text: str) -> bytes:
    return event(obj({"content": text}))


HEAD, TAIL = content("\x00").split(b"\\u0000")  # the bytes around the text of a canonical content event


def around(mid: bytes) -> bytes:
    """An event with the canonical content event's bytes around `mid` (which may be anything)."""
    return HEAD + mid + TAIL


ROLE = event(obj({"role": "assistant", "content": ""}))
FINISH = event(obj({}, "stop"))
DONE = b"data: [DONE]\n\n"


class ParsedStream(NoFastPath, ChatStream):
    """The chat dialect without its fast path."""


def feed(
    chunks: list[bytes], *, hold: bool = False, dialect: str = "chat_completions", resume: bool = False,
    parsed: bool = False,
) -> Outcome:
    chosen = DIALECTS[dialect]
    if parsed:
        chosen = Dialect(chosen.name, json_body=True, anthropic=False, stream_factory=ParsedStream)
    guard = StreamGuard(chosen, hold=hold, may_resume=(lambda reason, status: True) if resume else None)
    steps: list[Step] = []
    for c in chunks:
        steps.append(guard.feed(c))
        if steps[-1].resume:  # (the relay reads no more of a broken stream)
            return outcome(guard, steps)
    steps.append(guard.end_of_stream())
    return outcome(guard, steps)


def reference(events: list[bytes], **kw: Any) -> Outcome:
    """The full parse every time."""
    return feed(events, parsed=True, **kw)


def fast(events: list[bytes], **kw: Any) -> Outcome:
    return feed(events, **kw)


def joined(events: list[bytes], **kw: Any) -> Outcome:
    return feed([b"".join(events)], **kw)


def same(events: list[bytes], **kw: Any) -> Outcome:
    ref = reference(events, **kw)
    assert fast(events, **kw) == ref
    assert joined(events, **kw) == ref
    assert feed([piece for e in events for piece in (e[:1], e[1:]) if piece], **kw) == ref
    return ref


# ---- the fast path is taken ---------------------------------------------------------------------


def test_a_repeated_content_event_is_recognised_without_a_parse() -> None:
    stream = DIALECTS["chat_completions"].new_stream()
    guard = StreamGuard(DIALECTS["chat_completions"], hold=False)
    guard._stream = stream  # (the guard's own stream, reachable for this check)
    guard.feed(ROLE)
    first = content("Hello")
    assert stream.repeats(first, 0, 10**6) == (0, 0)  # nothing learnt before a content event
    guard.feed(first)
    second = content(" world")
    assert stream.repeats(second, 0, 10**6) == (1, len(second))
    run = ROLE + second + second + around(b"\\u0041") + second
    assert stream.repeats(run, len(ROLE), 10**6) == (2, len(ROLE) + 2 * len(second))
    assert stream.repeats(second * 2, 0, len(second) - 1) == (0, 0)  # each event within the bound
    step = guard.feed(second + second)
    assert (step.data, step.content_events, step.first_content) == (second + second, 2, False)
    assert (guard.events, guard.content_events) == (4, 3)


def test_the_quick_path_is_the_guards_repeating_state_and_a_break_or_a_stitch_closes_it() -> None:
    answers = iter([True])  # one continuation, then a break ends the stream
    guard = StreamGuard(DIALECTS["chat_completions"], hold=True, may_resume=lambda reason, status: next(answers, False))
    guard.feed(ROLE)
    assert guard.state is GuardState.HOLDING
    guard.feed(content("Hello"))  # the first content: released, and the template learnt
    assert guard.state is GuardState.REPEATING
    world = content(" world")
    assert guard.feed(world[:20]).data == b""  # a read cut inside an event: the reader holds its start
    assert guard.state is GuardState.PARSING
    assert guard.feed(world[20:]).data == world
    assert guard.state is GuardState.REPEATING
    assert guard.fail(Reason.STREAM_CUT).resume is Reason.STREAM_CUT
    assert guard.state is GuardState.BROKEN
    guard.resume(lambda event: event)
    guard.feed(content("again"))
    assert guard.state is GuardState.PARSING  # a continuation's events are all rewritten: never the quick path
    assert guard.end_of_stream().done  # (cut again: no second continuation)
    assert guard.state is GuardState.DONE


def test_completions_text_is_a_leaf_too() -> None:
    def text(t: str) -> bytes:
        return event({"id": "cmpl-1", "object": "text_completion", "model": "m",
                      "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": None}]})  # fmt: skip

    stream = DIALECTS["completions"].new_stream()
    guard = StreamGuard(DIALECTS["completions"], hold=False)
    guard._stream = stream
    guard.feed(text("a"))
    assert stream.repeats(text("bc"), 0, 10**6) == (1, len(text("bc")))
    same([text("a"), text("b"), text(""), text("c"), event({"id": "cmpl-1", "choices": [
        {"index": 0, "text": "", "finish_reason": "length"}]}), DONE], dialect="completions")  # fmt: skip


def test_a_normal_stream_is_byte_identical_on_both_paths() -> None:
    events = [ROLE, *(content(f" w{i}") for i in range(50)), FINISH, DONE]
    ref = same(events)
    assert ref.data == b"".join(events)
    assert (ref.outcome, ref.reason, ref.content_events, ref.first_content) == ("ok", "complete", 50, 1)


class CountingStream(ChatStream):
    """The chat dialect, counting the events it was asked to classify (parsed)."""

    parsed = 0

    def classify(self, event: Event) -> Kind:
        CountingStream.parsed += 1
        return super().classify(event)


COUNTING = Dialect("chat_completions", json_body=True, anthropic=False, stream_factory=CountingStream)


def test_reads_cut_mid_event_go_back_to_the_fast_path() -> None:
    CountingStream.parsed = 0
    guard = StreamGuard(COUNTING, hold=True)
    events = [ROLE, *(content(f"t{i}") for i in range(100)), FINISH, DONE]
    whole = b"".join(events)
    size = len(content("t10")) * 5 + 17  # every read ends inside an event
    steps = [guard.feed(whole[i : i + size]) for i in range(0, len(whole), size)]
    assert b"".join(s.data for s in steps) == whole
    assert steps[-1].reason == "complete"
    assert sum(s.content_events for s in steps) == 100
    # parsed: what the first read holds (nothing is committed before it), the finish chunk and
    # [DONE]; not the content events, not even those cut in two by a read
    first_read = whole[:size].count(b"\n\n") + 1
    assert CountingStream.parsed <= first_read + 2 < 10
    assert feed([whole[i : i + size] for i in range(0, len(whole), size)]) == reference(events)


@pytest.mark.parametrize(
    ("cut_in", "after"),
    [
        (content("bb"), content("c")),
        (content("bb"), b""),
        (around(b"\\ud800"), content("c")),  # the completed event is a look-alike
        (around(b'x"'), content("c")),
        (around("é".encode()), content("c")),
        (around(b"\xff"), content("c")),
        (content("bb") + content("b2"), content("c")),  # the LF of a blank line in the next read
        (content("bb") + b"data: {oops}\n\n", content("c")),  # ... then what is not a repeat
        (b"id: 1\n" + content("bb"), content("c")),
        (b": ping\n\n" + content("bb"), content("c")),
        (content("bb").replace(b"\n\n", b"\r\n\r\n"), content("c")),
        (b"data: {oops}\n\n", content("c")),
    ],
)
def test_an_event_cut_by_a_read_at_any_byte_gets_the_full_parse_verdict(cut_in: bytes, after: bytes) -> None:
    for cut in range(1, len(cut_in)):
        events = [ROLE, content("a"), content("b"), cut_in[:cut], cut_in[cut:] + after + content("d"), FINISH, DONE]
        assert fast(events) == reference(events)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 50, 63, 64, 65, 199, 1000, 10_000])
def test_every_read_size_gives_the_full_parse_verdict(size: int) -> None:
    events = [ROLE, *(content(f"t{i}") for i in range(20)), around(b"\\ud800"), content("x"), b": c\n\n",
              around(b'"'), content("y"), b"data: {\n\n", content("z"), FINISH, DONE]  # fmt: skip
    whole = b"".join(events)
    for hold in (False, True):
        chunks = [whole[i : i + size] for i in range(0, len(whole), size)]
        assert feed(chunks, hold=hold) == reference(events, hold=hold)


# ---- what looks like content but is not ---------------------------------------------------------

ADVERSARIAL = [
    b"",  # empty text: not content
    b'x","finish_reason":"abort',  # a quote ends the string early: another object (or none)
    b'x"},"logprobs":null,"finish_reason":"abort"}]} , {"a":"',
    b"\\ud800",  # a lone surrogate: orjson refuses it (malformed)
    b"\\ud83d\\ude00",  # a valid pair: content, but judged by the parser
    b"\\u0041",
    b"\xff\xfe",  # not UTF-8: malformed
    b"\xed\xa0\x80",  # a UTF-8-encoded surrogate: malformed
    b"\xc3",  # a cut UTF-8 sequence
    "héllo wörld 日本".encode(),  # valid UTF-8: content
    b"a\x01b",  # a raw control character: malformed
    b"a\tb",
    b"a\nb",  # a raw line end: the event ends early (a read of one event is not judged by its ends)
    b"a\n\nb",
    b"\\x",  # an unknown escape: malformed
    b"a\\",  # a backslash escaping the closing quote
    b"a\\\\",  # an escaped backslash: content
    b"\\/\\\"\\b\\f\\n\\r\\t",
    b"\x7f",
]


@pytest.mark.parametrize("mid", ADVERSARIAL)
def test_look_alike_events_get_the_full_parse_verdict(mid: bytes) -> None:
    same([ROLE, content("a"), around(mid), content("b"), FINISH, DONE])
    same([ROLE, content("a"), around(mid) + content("b"), FINISH, DONE])


def test_the_template_refuses_what_the_parser_would_refuse() -> None:
    template = ContentTemplate()
    data = content("a")[6:-2]
    parsed = orjson.loads(data)
    template.learn(data, parsed, parsed["choices"][0]["delta"], "content")
    for mid in ADVERSARIAL:
        probe = around(mid)[6:-2]
        if template.matches(probe, 0, len(probe)):
            text = orjson.loads(probe)["choices"][0]["delta"]["content"]
            assert type(text) is str
            assert text
    plain = content("b")[6:-2]
    assert template.matches(plain, 0, len(plain))


@pytest.mark.parametrize(
    "events",
    [
        # a repeat whose chunk also carries what is not a repeat
        [ROLE, content("a"), content("b") + b"data: {oops\n\n", FINISH, DONE],
        [ROLE, content("a"), content("b") + around(b'x","finish_reason":"abort'), DONE],
        [ROLE, content("a"), content("b") + FINISH + DONE],
        [ROLE, content("a"), content("b") + content("c")[:-1], b"\n", FINISH, DONE],
        [ROLE, content("a"), content("b") + b": comment\n\n", FINISH, DONE],
        [ROLE, content("a"), b"id: 7\n" + content("b"), content("c"), FINISH, DONE],
        [ROLE, content("a"), b"event: error\n" + content("b"), FINISH, DONE],
        [ROLE, content("a"), content("b").replace(b"\n\n", b"\r\n\r\n"), content("c"), FINISH, DONE],
        [ROLE, content("a"), content("b") + b"HTTP/1.1 500 Oops\r\n\r\n{}", FINISH, DONE],
        [ROLE, content("a"), content("b"), b"\n", content("c"), FINISH, DONE],
        # the same object, another encoding: never a template, always parsed
        [ROLE, *(event(b'{"choices": [{"index": 0, "delta": {"content": "%d"}}]}' % i) for i in range(5)), DONE],
        [ROLE, *(event(b'{"choices":[{"index":0,"delta":{"content":"a","content":"%d"}}]}' % i) for i in range(5))],
        # what a repeat must not carry: a finish reason, usage, a second choice
        [ROLE, content("a"), event(obj({"content": "b"}, "abort")), content("c")],
        [ROLE, content("a"), event(obj({"content": "b"}, "length")), content("c"), DONE],
        [ROLE, content("a"), event(obj({"content": "b"}, usage={"prompt_tokens": 1, "completion_tokens": 2}))],
        [ROLE, content("a"), event({**BASE, "choices": [{"index": 0, "delta": {"content": "b"}},
                                                        {"index": 1, "delta": {"content": "c"}}]}), content("d"), DONE],
        # the stream's own bytes change (llama.cpp's `created` each second): learnt again
        [ROLE, content("a"), content("b"), event({**obj({"content": "c"}), "created": 2}),
         event({**obj({"content": "d"}), "created": 2}), FINISH, DONE],
        # state a repeat would set again: a finish reason or usage changed in between, a second choice
        [ROLE, event(obj({"content": "a"}, "length")), event(obj({}, "stop")), event(obj({"content": "b"}, "length"))],
        [ROLE, event(obj({"content": "a"}, usage={"prompt_tokens": 1, "completion_tokens": 2})),
         event({**BASE, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 9}}),
         event(obj({"content": "b"}, usage={"prompt_tokens": 1, "completion_tokens": 2}))],
        [ROLE, event({**BASE, "choices": [{"index": 0, "delta": {"content": "a"}},
                                          {"index": 1, "delta": {}, "finish_reason": "length"}]}),
         event({**BASE, "choices": [{"index": 1, "delta": {}, "finish_reason": "stop"}]}),
         event({**BASE, "choices": [{"index": 0, "delta": {"content": "b"}},
                                    {"index": 1, "delta": {}, "finish_reason": "length"}]}), DONE],
        [ROLE, event({**BASE, "choices": [1, {"index": 0, "delta": {"content": "a"}}]}), content("b")],
        # a partial event pending in the reader: what follows is part of it, not an event of its own
        [ROLE, content("a"), b"data: {oops", content("b"), content("c"), FINISH, DONE],
        [ROLE, content("a"), content("b")[:-1], content("c"), FINISH, DONE],
        # a stray HTTP block whose body (by Content-Length) holds what looks like a repeat
        [ROLE, content("a"), b"HTTP/1.1 500 Oops\nContent-Length: %d\n\nx" % len(b"xy\n\n" + content("b")),
         b"y\n\n" + content("b") + content("c"), FINISH, DONE],
        # nested deeper than orjson writes: parsed, never a template
        [ROLE, *(event(b'{"x":%s,"choices":[{"index":0,"delta":{"content":"%d"}}]}' % (b"[" * 300 + b"]" * 300, i))
                 for i in range(3)), FINISH, DONE],
        # a model named in the event with the text: the first names the response's model
        [event(obj({"content": "a"}) | {"model": "x"}), event(obj({"content": "b"}) | {"model": "y"}), FINISH, DONE],
    ],
)
def test_mixed_chunks_get_the_full_parse_verdict(events: list[bytes]) -> None:
    for hold in (False, True):
        same(events, hold=hold)


@pytest.mark.parametrize(
    "broken",
    [
        b"HTTP/1.1 503 Busy\nContent-Length: 2\n\n{}",
        event({"error": {"message": "boom", "type": "server_error"}}),
        event({"detail": "boom"}),
        event(obj({"content": "x"}, "abort")),
        DONE,
    ],
)
def test_a_break_after_repeats_in_one_read_asks_to_resume_as_before(broken: bytes) -> None:
    """--resume-on-cut: what the read held before the break goes out, the rest of it is not read."""
    events = [ROLE, content("a"), content("b") + content("c") + broken + content("d") + content("e")]
    ref = same(events, resume=True)
    assert ref.resume is not None
    assert content("c") in ref.data
    assert content("d") not in ref.data


def test_an_oversized_run_of_repeats_is_left_to_the_reader() -> None:
    guard = StreamGuard(DIALECTS["chat_completions"], hold=False, max_event_size=len(content("a")) * 3)
    guard.feed(content("a"))
    step = guard.feed(content("b") * 4)  # longer than the bound, each event within it
    assert (step.data, step.done, step.content_events) == (content("b") * 4, False, 4)


def test_a_repeat_past_the_event_bound_is_still_oversized() -> None:
    guard = StreamGuard(DIALECTS["chat_completions"], hold=False, max_event_size=len(content("a")) + 10)
    guard.feed(content("a"))
    step = guard.feed(content("b" * 100))
    assert (step.done, step.reason, guard.rewrites) == (True, "stream_cut", ["oversized_event"])


# ---- property: any mix, any chunking --------------------------------------------------------------

_pieces = st.one_of(
    st.text(max_size=8).map(content),
    st.binary(max_size=8).map(around),
    st.sampled_from(ADVERSARIAL).map(around),
    st.sampled_from([ROLE, FINISH, DONE, b": ping\n\n", event(obj({"content": "x"}, "abort"))]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_pieces, max_size=12), st.lists(st.integers(0, 2000), max_size=6), st.booleans())
def test_any_stream_any_chunking_matches_the_full_parse(events: list[bytes], cuts: list[int], hold: bool) -> None:
    events = [ROLE, content("first"), *events]
    ref = reference(events, hold=hold)
    assert fast(events, hold=hold) == ref
    whole = b"".join(events)
    bounds = sorted({0, len(whole), *(c for c in cuts if c < len(whole))})
    chunked = feed([whole[a:b] for a, b in itertools.pairwise(bounds)], hold=hold)
    assert chunked == ref


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=12))
def test_any_bytes_as_text_match_the_parser(mid: bytes) -> None:
    template = ContentTemplate()
    data = content("a")[6:-2]
    parsed = orjson.loads(data)
    template.learn(data, parsed, parsed["choices"][0]["delta"], "content")
    probe = around(mid)[6:-2]
    try:
        text = orjson.loads(probe)["choices"][0]["delta"]["content"]
    except (orjson.JSONDecodeError, KeyError, TypeError, IndexError):
        text = None
    if template.matches(probe, 0, len(probe)):
        assert type(text) is str
        assert text
