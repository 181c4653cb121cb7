"""The stream guard end to end, seen by a raw HTTP client: the exact bytes a failing upstream stream becomes.

For every fault scenario of the fake upstream and every dialect it applies to, a plain aiohttp client
reads the proxy's answer and parses the SSE itself: the status line (a failure before any content is a
real HTTP status while the headers are held, an in-stream error frame with ``hold_headers=0``), the
events passed before the failure (byte-identical to the healthy stream's first events), the error frame
and the dialect's terminal, that nothing follows them, and the log line's outcome and reason (design
sections 3, 5 and 10). The expected shapes are written out here from the design, not computed with the
product's own helpers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from multidict import CIMultiDictProxy
from support import WAIT, FakeUpstream, Proxy, ProxyFactory
from support.guard_cases import (
    ALL,
    CHAT_LIKE,
    CUT_MESSAGE,
    EARLY_DONE_MESSAGE,
    EVENT_LIMIT,
    FAKE_MESSAGE,
    OPENAI_TYPE,
    OVERSIZED_MESSAGE,
    PREAMBLE,
    REQUESTS,
    RESPONSES_CODE,
    STALL_MESSAGE,
    STRAY_MESSAGE,
    error_body,
)

TOKENS = 4

STALL = {"idle_timeout": 0.5}
OVERSIZED = {"max_event_size": EVENT_LIMIT}


# ---- a small SSE reader of our own --------------------------------------------------------------------


@dataclass
class Frame:
    raw: bytes
    fields: list[tuple[str, str]]

    @property
    def event(self) -> str | None:
        names = [value for name, value in self.fields if name == "event"]
        return names[-1] if names else None

    @property
    def data(self) -> str:
        return "\n".join(value for name, value in self.fields if name == "data")

    def json(self) -> Any:
        return orjson.loads(self.data)


def parse_sse(body: bytes) -> list[Frame]:
    """Every block of an LF-framed SSE body; the body must end on a blank line (no partial event)."""
    if not body:
        return []
    assert body.endswith(b"\n\n"), f"the stream does not end on an event boundary: {body[-80:]!r}"
    frames = []
    for block in body[:-2].split(b"\n\n"):
        assert block, "an empty block (a doubled blank line) in the stream"
        fields = []
        for line in block.decode().split("\n"):
            name, _, value = line.partition(":")
            fields.append((name, value[1:] if value.startswith(" ") else value))
        frames.append(Frame(block + b"\n\n", fields))
    assert b"".join(f.raw for f in frames) == body
    return frames


# ---- talking to the proxy and the fake --------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: CIMultiDictProxy[str]
    body: bytes
    elapsed: float
    frames: list[Frame] = field(default_factory=list)


async def call(
    http: aiohttp.ClientSession, base: str, dialect: str, rid: str, fault: str | None = None,
    *, stream: bool = True, body: dict[str, Any] | None = None,
) -> Reply:  # fmt: skip
    """One request; the whole answer within WAIT seconds (the fake's silences last 600 s)."""
    path, default = REQUESTS[dialect]
    headers = {"X-Request-Id": rid}
    if fault is not None:
        headers["x-fault"] = fault
    started = time.monotonic()
    async with asyncio.timeout(WAIT):
        async with http.post(base + path, json={**(body or default), "stream": stream}, headers=headers) as resp:
            raw = await resp.read()
    reply = Reply(resp.status, resp.headers, raw, time.monotonic() - started)
    if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
        reply.frames = parse_sse(raw)
    return reply


async def healthy_frames(http: aiohttp.ClientSession, fake: FakeUpstream, dialect: str, rid: str) -> list[Frame]:
    """The stream the fake sends for this request id without a fault, straight from the fake."""
    reply = await call(http, fake.url, dialect, rid)
    assert reply.status == 200
    return reply.frames


def verdict(line: dict[str, Any]) -> tuple[str, str, int, int]:
    """outcome, reason, status to the client, upstream status."""
    return line["outcome"], line["reason"], line["status"], line["upstream_status"]


def rewrites(proxy: Proxy, dialect: str, reason: str) -> float:
    return proxy.sample("streamwarden_stream_rewrites_total", {"api": dialect, "reason": reason})


# ---- what a dialect's error looks like --------------------------------------------------------------


def check_framing(dialect: str, frames: list[Frame]) -> None:
    """OpenAI dialects never get `id:`/`retry:`; every Anthropic frame is named; sequence numbers rise."""
    for frame in frames:
        names = {name for name, _ in frame.fields}
        if dialect == "messages":
            assert "event" in names, frame.raw
        else:
            assert not names & {"id", "retry"}, frame.raw
    if dialect == "responses":
        numbers = [frame.json()["sequence_number"] for frame in frames]
        assert numbers == sorted(set(numbers)), numbers


def check_error_ending(dialect: str, frames: list[Frame], status: int, message: str, code: str) -> list[Frame]:
    """The proxy's error ending is the last thing in the stream; returns the frames before it."""
    check_framing(dialect, frames)
    if dialect in CHAT_LIKE:
        *before, error, done = frames
        assert done.raw == b"data: [DONE]\n\n"
        assert [name for name, _ in error.fields] == ["data"]
        assert error.json() == error_body(dialect, status, message, code)
    elif dialect == "responses":
        *before, failed, error = frames
        assert failed.event == "response.failed"
        failed_data = failed.json()
        assert failed_data["type"] == "response.failed"
        response = failed_data["response"]
        assert response["status"] == "failed"
        assert response["error"] == {"code": RESPONSES_CODE[status], "message": message}
        created = [f.json()["response"] for f in before if f.event == "response.created"]
        if created:
            assert response["id"] == created[0]["id"]
        assert error.event == "error"
        nested = {"type": OPENAI_TYPE[status], "code": code, "message": message, "param": None}
        assert error.json() == {
            "type": "error", "sequence_number": failed_data["sequence_number"] + 1,
            "code": code, "message": message, "param": None, "error": nested,
        }  # fmt: skip
    else:
        *before, error = frames
        assert error.event == "error"
        assert error.json() == error_body(dialect, status, message, code)
    assert not any(b"error" in f.raw.split(b"data:")[0] or f.data.startswith('{"error"') for f in before)
    assert not any(f.raw == b"data: [DONE]\n\n" or f.event in ("message_stop", "response.completed") for f in before)
    return before


# ---- the scenarios ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    fault: str  # may use {pre} (the dialect's preamble length)
    dialects: tuple[str, ...]
    passed: Callable[[str], int]  # how many healthy frames precede the failure
    status: int
    message: str
    code: str | int  # the error code the client sees: the upstream's own when it gave one, else the reason
    reason: str
    rewrite: str | None
    config: dict[str, Any] = field(default_factory=dict)

    def fault_for(self, dialect: str) -> str:
        return self.fault.format(pre=PREAMBLE[dialect], next=PREAMBLE[dialect] + 1)


def _pre(d: str) -> int:
    return PREAMBLE[d]


def _first(d: str) -> int:
    return PREAMBLE[d] + 1


def _two(d: str) -> int:
    return PREAMBLE[d] + 2


def _all_content(d: str) -> int:
    return PREAMBLE[d] + TOKENS


def _all_but_terminal(d: str) -> int:
    return PREAMBLE[d] + TOKENS + 3  # responses: the three *.done events before response.completed


# Failures after the first content event: the 200 is out, so they end the stream with an error frame.
IN_STREAM = {
    "stray_503": Case("stray_503;after={next}", ALL, _first, 503, STRAY_MESSAGE, 503,  # the upstream's own code
                      "stray_http_block", "stray_http_block"),
    "cut": Case("cut", ALL, _two, 502, CUT_MESSAGE, "stream_cut", "stream_cut", "stream_cut"),
    "cut_eof": Case("cut;eof=1", ALL, _two, 502, CUT_MESSAGE, "stream_cut", "stream_cut", "stream_cut"),
    "reset": Case("reset", ALL, _two, 502, CUT_MESSAGE, "stream_cut", "stream_cut", "stream_cut"),
    "stall": Case("stall;hold=30", ALL, _first, 504, STALL_MESSAGE, "stall_timeout", "stall_timeout",
                  "stall_timeout", STALL),
    "oversized_event": Case("oversized_event;size=65536", ALL, _first, 502, OVERSIZED_MESSAGE, "stream_cut",
                            "stream_cut", "oversized_event", OVERSIZED),
    "no_terminal": Case("no_terminal", ("responses",), _all_but_terminal, 502, CUT_MESSAGE, "stream_cut", "stream_cut",
                        "stream_cut"),
    "error_object_foreign": Case("error_object_foreign", CHAT_LIKE, _first, 400, FAKE_MESSAGE,
                                 400, "upstream_error_frame", "foreign_error_frame"),
    "error_string": Case("error_string", CHAT_LIKE, _first, 502, FAKE_MESSAGE, "upstream_error_frame",
                         "upstream_error_frame", "foreign_error_frame"),
    "error_field": Case("error_field", CHAT_LIKE, _first, 500, FAKE_MESSAGE, 500,
                        "upstream_error_frame", "foreign_error_frame"),
    "done_without_finish": Case("done_without_finish", CHAT_LIKE, _all_content, 502, EARLY_DONE_MESSAGE,
                                "stream_cut", "stream_cut", "stream_cut"),
}  # fmt: skip

# Failures before any content: a real status while the headers are held, a frame after the preamble without.
BEFORE_CONTENT = {
    "stray_503": Case("stray_503;after={pre}", ALL, _pre, 503, STRAY_MESSAGE, 503,
                      "stray_http_block", "stray_http_block"),
    "cut": Case("cut;after={pre}", ALL, _pre, 502, CUT_MESSAGE, "stream_cut", "stream_cut", "stream_cut"),
    "reset": Case("reset;after={pre}", ALL, _pre, 502, CUT_MESSAGE, "stream_cut", "stream_cut", "stream_cut"),
    "stall": Case("stall;after={pre};hold=30", ALL, _pre, 504, STALL_MESSAGE, "stall_timeout", "stall_timeout",
                  "stall_timeout", STALL),
    "oversized_event": Case("oversized_event;size=65536;at=0", ALL, _pre, 502, OVERSIZED_MESSAGE, "stream_cut",
                            "stream_cut", "oversized_event", OVERSIZED),
}  # fmt: skip

# A bug found by these tests (see the report): complete events that arrived in the same read as the start
# of an oversized event are dropped, so what the client gets depends on how the upstream's bytes were split.


def cases(table: dict[str, Case]) -> list[Any]:
    """One param per (scenario, dialect)."""
    return [
        pytest.param(case, dialect, id=f"{name}-{dialect}") for name, case in table.items() for dialect in case.dialects
    ]


async def _check_in_stream(
    proxy: Proxy, reply: Reply, healthy: list[Frame], case: Case, dialect: str, rid: str, rewrite: str | None
) -> None:
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("text/event-stream")
    assert reply.headers["X-Request-Id"] == rid
    before = check_error_ending(dialect, reply.frames, case.status, case.message, case.code)
    passed = case.passed(dialect)
    assert [f.raw for f in before] == [f.raw for f in healthy[:passed]]
    line = await proxy.line_for(rid)
    assert verdict(line) == ("error", case.reason, 200, 200)
    assert (line["api"], line["stream"]) == (dialect, True)
    assert line["upstream_cancelled"] is True
    if rewrite is not None:
        assert rewrites(proxy, dialect, rewrite) == 1
    assert rewrites(proxy, dialect, "late_commit_status") == 0


@pytest.mark.parametrize(("case", "dialect"), cases(IN_STREAM))
async def test_failure_after_content_is_an_error_frame(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, http: aiohttp.ClientSession, case: Case, dialect: str
) -> None:
    proxy = await make_proxy(**case.config)
    rid = f"in-stream-{dialect}"
    reply = await call(http, proxy.url, dialect, rid, case.fault_for(dialect))
    healthy = await healthy_frames(http, fake_upstream, dialect, rid)
    await _check_in_stream(proxy, reply, healthy, case, dialect, rid, case.rewrite)


@pytest.mark.parametrize(("case", "dialect"), cases(BEFORE_CONTENT))
async def test_failure_before_content_is_a_real_status(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, http: aiohttp.ClientSession, case: Case, dialect: str
) -> None:
    """Late commit (hold_headers 10 s): the held preamble is dropped and the client gets the status."""
    proxy = await make_proxy(**case.config)
    rid = f"late-commit-{dialect}"
    reply = await call(http, proxy.url, dialect, rid, case.fault_for(dialect))
    assert reply.status == case.status
    assert reply.headers["Content-Type"].startswith("application/json")
    assert reply.headers["X-Request-Id"] == rid
    assert orjson.loads(reply.body) == error_body(dialect, case.status, case.message, case.code)
    # The stray block carried Retry-After: 1 (the SDKs retry on it); the proxy's own failures carry none.
    assert reply.headers.get("Retry-After") == ("1" if case.reason == "stray_http_block" else None)
    line = await proxy.line_for(rid)
    assert verdict(line) == ("error", case.reason, case.status, 200)
    assert line["upstream_cancelled"] is True
    assert rewrites(proxy, dialect, "late_commit_status") == 1


@pytest.mark.parametrize(("case", "dialect"), cases(BEFORE_CONTENT))
async def test_failure_before_content_without_hold_is_an_error_frame(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, http: aiohttp.ClientSession, case: Case, dialect: str
) -> None:
    """hold_headers=0: the 200 goes out at once, so the same failure ends the stream in-band."""
    proxy = await make_proxy(hold_headers=0, **case.config)
    rid = f"no-hold-{dialect}"
    reply = await call(http, proxy.url, dialect, rid, case.fault_for(dialect))
    healthy = await healthy_frames(http, fake_upstream, dialect, rid)
    await _check_in_stream(proxy, reply, healthy, case, dialect, rid, case.rewrite)


@pytest.mark.parametrize("dialect", ALL)
async def test_hold_window_expires_then_failure_is_an_error_frame(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, http: aiohttp.ClientSession, dialect: str
) -> None:
    """Only the preamble, then silence: after the hold window the 200 and the held events go out, then
    keep-alive comments while the upstream stays silent, then the stall's error frame."""
    proxy = await make_proxy(hold_headers=0.1, keepalive_interval=0.1, idle_timeout=0.6)
    rid = f"hold-expired-{dialect}"
    case = BEFORE_CONTENT["stall"]
    reply = await call(http, proxy.url, dialect, rid, case.fault_for(dialect))
    healthy = await healthy_frames(http, fake_upstream, dialect, rid)
    kinds = ["keep-alive" if f.raw == b": keep-alive\n\n" else "event" for f in reply.frames]
    ending = 2 if dialect != "messages" else 1
    pre = PREAMBLE[dialect]
    assert kinds[:pre] == ["event"] * pre
    assert kinds[pre:-ending] == ["keep-alive"] * (len(kinds) - pre - ending)
    assert len(kinds) - pre - ending >= 1
    reply.frames = [f for f in reply.frames if f.raw != b": keep-alive\n\n"]
    await _check_in_stream(proxy, reply, healthy, case, dialect, rid, "stall_timeout")


@pytest.mark.parametrize("dialect", ALL)
async def test_upstream_error_then_open_connection(
    proxy: Proxy, fake_upstream: FakeUpstream, http: aiohttp.ClientSession, dialect: str
) -> None:
    """The dialect's own error frame passes as is, the stream ends at once and the upstream is closed."""
    rid = f"error-after-first-{dialect}"
    # The fake keeps the connection open for 600 s after its error frame: only a proxy that waits for more
    # reaches the bound.
    reply = await call(http, proxy.url, dialect, rid, "error_after_first")
    record = await fake_upstream.recorder.wait_finished(rid)
    assert record.client_closed_at is not None
    assert not record.completed
    healthy = await healthy_frames(http, fake_upstream, dialect, rid)
    assert reply.status == 200
    check_framing(dialect, reply.frames)
    first = PREAMBLE[dialect] + 1
    assert [f.raw for f in reply.frames[:first]] == [f.raw for f in healthy[:first]]
    ending = reply.frames[first:]
    if dialect in CHAT_LIKE:
        native = {"error": {"message": FAKE_MESSAGE, "type": "InternalServerError", "param": None, "code": 500}}
        assert [f.json() for f in ending[:1]] == [native]
        assert [f.raw for f in ending[1:]] == [b"data: [DONE]\n\n"]
    elif dialect == "responses":
        # Whatever shape the upstream's `error` had, the ending is the pair `response.failed` then `error`.
        assert [f.event for f in ending] == ["response.failed", "error"]
        failed, error = (f.json() for f in ending)
        assert error["error"]["message"] == error["message"] == FAKE_MESSAGE
        assert error["sequence_number"] == failed["sequence_number"] + 1
        assert failed["response"]["status"] == "failed"
        assert failed["response"]["error"] == {"code": "server_error", "message": FAKE_MESSAGE}
        assert failed["response"]["id"] == reply.frames[0].json()["response"]["id"]
    else:
        assert [f.event for f in ending] == ["error"]
        assert ending[0].json() == {"type": "error", "error": {"type": "api_error", "message": FAKE_MESSAGE}}
    line = await proxy.line_for(rid)
    assert (line["outcome"], line["reason"], line["upstream_cancelled"]) == ("error", "upstream_error_frame", True)
    assert proxy.sample("streamwarden_upstream_cancellations_total", {"api": dialect, "reason": "upstream_error"}) == 1


@pytest.mark.parametrize("dialect", ALL)
async def test_stall_closes_the_upstream(
    make_proxy: ProxyFactory, fake_upstream: FakeUpstream, http: aiohttp.ClientSession, dialect: str
) -> None:
    proxy = await make_proxy(idle_timeout=0.3)
    rid = f"stall-closes-{dialect}"
    reply = await call(http, proxy.url, dialect, rid, "stall")  # the fake's silence: 600 s
    assert reply.status == 200
    record = await fake_upstream.recorder.wait_finished(rid)
    assert record.client_closed_at is not None
    assert proxy.sample("streamwarden_upstream_cancellations_total", {"api": dialect, "reason": "stall_timeout"}) == 1


# ---- streams that end well after all ----------------------------------------------------------------


@pytest.mark.parametrize("dialect", ["chat_completions", "completions", "messages"])
async def test_missing_terminal_after_finish_is_added(
    proxy: Proxy, fake_upstream: FakeUpstream, http: aiohttp.ClientSession, dialect: str
) -> None:
    """`no_terminal`: the generation visibly finished, so the proxy adds exactly the healthy terminal."""
    rid = f"no-terminal-{dialect}"
    reply = await call(http, proxy.url, dialect, rid, "no_terminal")
    healthy = await call(http, fake_upstream.url, dialect, rid)
    assert reply.status == 200
    assert reply.body == healthy.body
    line = await proxy.line_for(rid)
    assert (line["outcome"], line["reason"], line["upstream_cancelled"]) == ("ok", "complete", False)
    assert rewrites(proxy, dialect, "missing_terminal") == 1


@pytest.mark.parametrize("dialect", ALL)
async def test_malformed_event_is_dropped(
    proxy: Proxy, fake_upstream: FakeUpstream, http: aiohttp.ClientSession, dialect: str
) -> None:
    """`malformed_event` is the healthy stream plus one event of cut-off JSON: the proxy drops just that."""
    rid = f"malformed-{dialect}"
    direct = await call(http, fake_upstream.url, dialect, rid, "malformed_event")
    reply = await call(http, proxy.url, dialect, rid, "malformed_event")
    healthy = await call(http, fake_upstream.url, dialect, rid)
    assert len(direct.frames) == len(healthy.frames) + 1  # the fault really sent one more event
    assert reply.status == 200
    assert reply.body == healthy.body
    line = await proxy.line_for(rid)
    assert (line["outcome"], line["reason"]) == ("ok", "complete")
    assert rewrites(proxy, dialect, "malformed_event") == 1


@pytest.mark.parametrize("dialect", ALL)
async def test_retried_request_after_late_commit_streams_normally(
    proxy: Proxy, fake_upstream: FakeUpstream, http: aiohttp.ClientSession, dialect: str
) -> None:
    """`fail_first;mode=stream`: a stray 503 in the first attempt is a real 503, the retry a whole stream."""
    rid = f"fail-first-{dialect}"
    fault = "fail_first;mode=stream"
    first = await call(http, proxy.url, dialect, rid, fault)
    second = await call(http, proxy.url, dialect, rid + "-2", fault)
    assert first.status == 503
    assert first.headers["Retry-After"] == "1"
    assert orjson.loads(first.body) == error_body(dialect, 503, STRAY_MESSAGE, 503)  # the upstream's own code
    assert second.status == 200
    check_framing(dialect, second.frames)
    terminal = {"responses": "response.completed", "messages": "message_stop"}.get(dialect)
    if terminal is None:
        assert second.frames[-1].raw == b"data: [DONE]\n\n"
    else:
        assert second.frames[-1].event == terminal
    lines = [await proxy.line_for(rid), await proxy.line_for(rid + "-2")]
    assert [(line["outcome"], line["reason"]) for line in lines] == [("error", "stray_http_block"), ("ok", "complete")]
