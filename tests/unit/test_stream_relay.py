"""The stream relay as a state machine, without sockets: a fake transport, a fake upstream link and a
loop whose clock the test moves (every timer: the hold window, the idle timeout, keep-alive comments,
a stalled client), in the manner of uvicorn's MockTransport and MockLoop tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from multidict import CIMultiDict
from support.fake_io import ClockLoop, Exchange, FakeLink, advance, chat_chunk, run, turns

from proxy.core.dialects import Dialect, Kind
from proxy.core.dialects.chat import ChatStream
from proxy.core.guard import StreamGuard
from proxy.core.lifecycle import Cancellation, Reason, Reply
from proxy.core.sse import Event
from proxy.exchange.errors import Cause, Interrupter, UpstreamFailure
from proxy.exchange.stream import (
    _NEXT,
    ENDED,
    FLOWING,
    HOLDING,
    RESUMING,
    SETTLING,
    RelayState,
    StreamRelay,
    relay_stream,
    stream_response,
)
from proxy.exchange.upstream import UpstreamHead

SSE_HEAD = UpstreamHead(200, "OK", CIMultiDict({"Content-Type": "text/event-stream"}), None)
FINISH = (b'data: {"id":"c1","object":"chat.completion.chunk",'
          b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n')
DONE = FINISH + b"data: [DONE]\n\n"
ROLE = b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'


class Running:
    """relay_stream on its own task, as the handler runs it."""

    def __init__(self, x: Exchange) -> None:
        self.x = x
        self.interrupter = Interrupter()
        self.task: asyncio.Task[None] = asyncio.ensure_future(
            relay_stream(x.link, SSE_HEAD, x.guard, x.out, x.life, x.ex, x.cfg, self.interrupter)
        )

    async def started(self) -> Running:
        await turns()
        assert self.x.link.sink is not None
        return self

    async def finished(self) -> None:
        await turns()
        assert self.task.done(), "the handler's side did not finish"
        self.task.result()


async def _start(x: Exchange) -> Running:
    return await Running(x).started()


def body_of(sent: bytes) -> bytes:
    """The chunked body's payload."""
    body = sent.partition(b"\r\n\r\n")[2]
    out = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        out += rest[:n]
        body = rest[n + 2 :]
    return out


def test_the_hold_window_keeps_the_200_until_it_ends() -> None:
    async def test(loop: ClockLoop) -> None:
        x = Exchange(hold=5.0)
        r = await _start(x)
        x.sink.body(ROLE)
        await turns()
        assert x.sent == b""  # held: nothing is committed yet
        await advance(loop, 4.9)
        assert x.sent == b""
        await advance(loop, 0.2)  # the window ends: the guard commits, the handler sends the 200
        assert x.sent.startswith(b"HTTP/1.1 200 ")
        assert body_of(x.sent) == ROLE
        assert x.life.committed
        assert x.link.reading  # read on once the status line is out
        x.sink.body(chat_chunk("Hi") + DONE)
        x.sink.end()
        await r.finished()
        assert x.life.ended is not None
        assert x.life.ended.reason is Reason.COMPLETE

    run(test)


def test_the_first_content_sends_the_200_from_its_own_callback() -> None:
    async def test(loop: ClockLoop) -> None:
        x = Exchange(hold=5.0)
        r = await _start(x)
        x.sink.body(ROLE + chat_chunk("A"))  # the first content commits: the 200 goes out now, no task wakes
        assert x.life.committed
        assert x.sent.startswith(b"HTTP/1.1 200 ")
        transport = x.channel.transport
        assert transport is not None
        assert len(transport.written) == 1  # the head and the held events in one write
        assert body_of(x.sent) == ROLE + chat_chunk("A")
        assert x.link.reading
        x.sink.body(chat_chunk("B") + DONE)
        x.sink.end()
        await r.finished()
        assert body_of(x.sent) == ROLE + chat_chunk("A") + chat_chunk("B") + DONE

    run(test)


def test_an_idle_upstream_ends_the_stream_with_a_stall_frame() -> None:
    async def test(loop: ClockLoop) -> None:
        x = Exchange(hold=0.0, idle_timeout=30.0, keepalive_interval=0.0)
        r = await _start(x)
        x.sink.body(chat_chunk("A"))
        await advance(loop, 29.0)
        assert x.life.ended is None
        await advance(loop, 1.5)
        await r.finished()
        ended = x.life.ended
        assert ended is not None
        expected = (Reason.STALL_TIMEOUT, Cancellation.STALL_TIMEOUT, Reply.FRAME)
        assert (ended.reason, ended.cancel, ended.reply) == expected
        assert b'"code":"stall_timeout"' in body_of(x.sent)
        assert x.sent.endswith(b"0\r\n\r\n")

    run(test)


def test_a_quiet_stream_gets_keepalive_comments() -> None:
    async def test(loop: ClockLoop) -> None:
        x = Exchange(hold=0.0, idle_timeout=100.0, keepalive_interval=10.0)
        r = await _start(x)
        x.sink.body(chat_chunk("A"))
        await advance(loop, 10.5)
        assert body_of(x.sent).endswith(b": keep-alive\n\n")
        await advance(loop, 10.5)
        assert body_of(x.sent).count(b": keep-alive\n\n") == 2
        x.sink.body(DONE)
        x.sink.end()
        await r.finished()

    run(test)


def test_a_full_client_buffer_pauses_the_upstream_and_a_drain_resumes_it() -> None:
    async def test(loop: ClockLoop) -> None:
        x = Exchange(hold=0.0, client_stall_timeout=60.0)
        r = await _start(x)
        x.sink.body(chat_chunk("A"))
        x.channel.pause_writing()
        assert not x.link.reading
        await advance(loop, 59.0)
        assert x.life.ended is None
        x.channel.resume_writing()
        assert x.link.reading
        await advance(loop, 5.0)  # the stall timer was cancelled by the drain
        assert x.life.ended is None
        x.sink.body(DONE)
        x.sink.end()
        await r.finished()
        assert x.life.ended is not None
        assert x.life.ended.reason is Reason.COMPLETE

    run(test)


def test_a_client_that_stays_paused_is_stalled_and_cut() -> None:
    async def test(loop: ClockLoop) -> None:
        x = Exchange(hold=0.0, client_stall_timeout=60.0, idle_timeout=600.0)
        r = await _start(x)
        x.sink.body(chat_chunk("A"))
        x.channel.pause_writing()
        await advance(loop, 61.0)
        await r.finished()
        ended = x.life.ended
        assert ended is not None
        assert (ended.reason, ended.reply) == (Reason.CLIENT_STALLED, Reply.CUT)
        transport = x.channel.transport
        assert transport is not None
        assert transport.aborted

    run(test)


def test_a_cut_upstream_after_the_commit_is_a_frame_and_a_proper_end() -> None:
    async def test(loop: ClockLoop) -> None:
        x = Exchange(hold=0.0)
        r = await _start(x)
        x.sink.body(chat_chunk("A"))
        x.sink.failed(UpstreamFailure(Reason.STREAM_CUT, "cut"))
        await r.finished()
        ended = x.life.ended
        assert ended is not None
        assert (ended.reason, ended.reply) == (Reason.STREAM_CUT, Reply.FRAME)
        assert b'"code":"stream_cut"' in body_of(x.sent)
        assert x.sent.endswith(b"0\r\n\r\n")

    run(test)


def test_a_failure_while_held_is_the_status_the_lifecycle_answers() -> None:
    async def test(loop: ClockLoop) -> None:
        x = Exchange(hold=5.0)
        r = await _start(x)
        x.sink.body(ROLE)
        x.sink.failed(UpstreamFailure(Reason.STREAM_CUT, "cut"))
        await r.finished()
        ended = x.life.ended
        assert ended is not None
        assert (ended.reason, ended.reply) == (Reason.STREAM_CUT, Reply.STATUS)
        assert x.sent.startswith(b"HTTP/1.1 502 ")
        assert ROLE not in x.sent

    run(test)


def test_shutdown_after_the_commit_is_a_frame_and_then_the_close() -> None:
    async def test(loop: ClockLoop) -> None:
        x = Exchange(hold=0.0)
        r = await _start(x)
        x.sink.body(chat_chunk("A"))
        r.interrupter.fire()
        await r.finished()
        ended = x.life.ended
        assert ended is not None
        assert (ended.reason, ended.reply) == (Reason.SHUTDOWN, Reply.FRAME)
        assert b'"code":"shutdown"' in body_of(x.sent)
        assert x.channel.closed_now  # the table's close column: now

    run(test)



# ---- the relay's table, one case per transition ------------------------------------------------------


def _relay(x: Exchange) -> StreamRelay:
    """A relay over `x` whose status line is held (HOLDING), attached to the fake upstream."""
    relay = StreamRelay(x.link, x.guard, x.life, x.ex, x.cfg, x.out, stream_response(SSE_HEAD))
    x.link.attach(relay)
    return relay


def _resumable(x: Exchange) -> None:
    x.guard = StreamGuard(x.dialect, hold=True, may_resume=lambda reason, status: True)


def _flowing(x: Exchange) -> StreamRelay:
    relay = _relay(x)
    x.sink.body(ROLE + chat_chunk("A"))
    assert relay.state is FLOWING
    return relay


def _resuming(x: Exchange) -> StreamRelay:
    _resumable(x)
    relay = _flowing(x)
    x.sink.failed(UpstreamFailure(Reason.STREAM_CUT, "cut"))
    assert relay.state is RESUMING
    return relay


async def _holding_flowing(loop: ClockLoop, x: Exchange) -> StreamRelay:
    relay = _relay(x)
    await advance(loop, x.cfg.hold_headers + 0.1)  # the hold window ends: the 200, from the timer's callback
    assert x.sent.startswith(b"HTTP/1.1 200 ")
    return relay


async def _holding_settling(loop: ClockLoop, x: Exchange) -> StreamRelay:
    relay = _relay(x)
    x.sink.body(ROLE)
    x.sink.failed(UpstreamFailure(Reason.STREAM_CUT, "cut"))  # nothing committed: a real status
    assert x.sent.startswith(b"HTTP/1.1 502 ")
    return relay


async def _holding_ended(loop: ClockLoop, x: Exchange) -> StreamRelay:
    relay = _relay(x)
    relay.interrupt(Cause.CLIENT_GONE)
    assert x.sent == b""
    return relay


async def _flowing_resuming(loop: ClockLoop, x: Exchange) -> StreamRelay:
    relay = _resuming(x)
    assert not x.link.reading
    return relay


async def _flowing_settling(loop: ClockLoop, x: Exchange) -> StreamRelay:
    relay = _flowing(x)
    x.sink.body(DONE)
    return relay


async def _flowing_ended(loop: ClockLoop, x: Exchange) -> StreamRelay:
    relay = _flowing(x)
    x.channel.pause_writing()
    await advance(loop, x.cfg.client_stall_timeout + 1)  # a stalled client is cut
    transport = x.channel.transport
    assert transport is not None
    assert transport.aborted
    return relay


async def _resuming_flowing(loop: ClockLoop, x: Exchange) -> StreamRelay:
    relay = _resuming(x)
    x.guard.resume(lambda event: event)
    continuation = FakeLink()
    relay.relink(continuation)
    assert continuation.sink is relay
    assert continuation.reading
    return relay


async def _resuming_settling(loop: ClockLoop, x: Exchange) -> StreamRelay:
    relay = _resuming(x)
    relay.give_up()  # no continuation: the frame the stream broke with
    assert b'"code":"stream_cut"' in body_of(x.sent)
    return relay


async def _resuming_ended(loop: ClockLoop, x: Exchange) -> StreamRelay:
    relay = _resuming(x)
    relay.give_up_for(Cause.CLIENT_GONE)
    return relay


async def _settling_ended(loop: ClockLoop, x: Exchange) -> StreamRelay:
    relay = await _flowing_settling(loop, x)
    assert relay.state is SETTLING
    relay.stop()  # the handler settled the reply
    return relay


_CASES: dict[tuple[RelayState, RelayState], Callable[[ClockLoop, Exchange], Awaitable[StreamRelay]]] = {
    (HOLDING, FLOWING): _holding_flowing,
    (HOLDING, SETTLING): _holding_settling,
    (HOLDING, ENDED): _holding_ended,
    (FLOWING, RESUMING): _flowing_resuming,
    (FLOWING, SETTLING): _flowing_settling,
    (FLOWING, ENDED): _flowing_ended,
    (RESUMING, FLOWING): _resuming_flowing,
    (RESUMING, SETTLING): _resuming_settling,
    (RESUMING, ENDED): _resuming_ended,
    (SETTLING, ENDED): _settling_ended,
}


def test_every_transition_of_the_table_has_its_case() -> None:
    table = {(a, b) for a, targets in _NEXT.items() for b in targets}
    assert set(_CASES) == table


@pytest.mark.parametrize("move", list(_CASES), ids=lambda m: f"{m[0].name}->{m[1].name}")
def test_a_transition(move: tuple[RelayState, RelayState]) -> None:
    async def test(loop: ClockLoop) -> None:
        x = Exchange(hold=5.0, client_stall_timeout=60.0, idle_timeout=600.0)
        relay = await _CASES[move](loop, x)
        assert relay.state is move[1]
        relay.stop()
        assert relay.state is ENDED

    run(test)


class _Bug(ChatStream):
    def classify(self, event: Event) -> Kind:
        raise RuntimeError("a bug of ours")


def test_a_bug_of_ours_is_raised_in_the_handler_and_ends_the_relay() -> None:
    async def test(loop: ClockLoop) -> None:
        x = Exchange(hold=5.0)
        x.guard = StreamGuard(Dialect("chat_completions", json_body=True, anthropic=False, stream_factory=_Bug),
                              hold=True)  # fmt: skip
        relay = _relay(x)
        relay.body(ROLE)  # (the dialect fails on it)
        assert relay.state is ENDED
        with pytest.raises(RuntimeError, match="a bug of ours"):
            await asyncio.wait_for(relay.wait(), 5)
        relay.stop()

    run(test)
