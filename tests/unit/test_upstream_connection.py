"""One upstream connection's protocol without a socket: byte scripts in, the head, the body's
batches and the end out to a sink, and what it refuses so the pool never mixes two answers."""

from __future__ import annotations

import asyncio
import gc

import pytest
from multidict import CIMultiDict
from support.fake_io import FakeTransport

from proxy.core.lifecycle import Reason
from proxy.exchange.errors import UpstreamFailure
from proxy.server.upstream_conn import Response, UpstreamConnection, encode_request

REQUEST = encode_request("POST", "/v1/chat/completions", "backend", CIMultiDict(), b"{}")
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


class Sink:
    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.ended = False
        self.failure: UpstreamFailure | None = None

    def body(self, data: bytes) -> None:
        self.pieces.append(data)

    def end(self) -> None:
        self.ended = True

    def failed(self, failure: UpstreamFailure) -> None:
        self.failure = failure


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def _connection() -> tuple[UpstreamConnection, FakeTransport, list[UpstreamConnection]]:
    lost: list[UpstreamConnection] = []
    connection = UpstreamConnection(lost.append)
    transport = FakeTransport()
    connection.connection_made(transport)
    return connection, transport, lost


@pytest.mark.parametrize("split", [None, 1, 7, len(HEAD) - 1])
async def test_a_head_then_a_chunked_body_one_batch_per_read(split: int | None) -> None:
    connection, transport, _ = _connection()
    waiter = connection.send(REQUEST, b"{}", head_only=False)
    assert transport.data == REQUEST + b"{}"
    if split is None:
        connection.data_received(HEAD)
    else:
        connection.data_received(HEAD[:split])
        assert not waiter.done()
        connection.data_received(HEAD[split:])
    head = await asyncio.wait_for(waiter, 5)
    assert head.status == 200
    assert head.headers["Content-Type"] == "text/event-stream"
    sink = Sink()
    connection.attach(sink)
    connection.data_received(chunk(b"data: a\n\n") + chunk(b"data: b\n\n"))
    assert sink.pieces == [b"data: a\n\ndata: b\n\n"]  # one read, one batch
    connection.data_received(b"0\r\n\r\n")
    assert sink.ended
    assert connection.complete
    assert connection.reusable


async def test_a_body_that_arrives_before_attach_is_delivered_on_attach() -> None:
    connection, _, _ = _connection()
    waiter = connection.send(REQUEST, None, head_only=False)
    connection.data_received(HEAD + chunk(b"data: early\n\n"))
    await asyncio.wait_for(waiter, 5)
    sink = Sink()
    connection.attach(sink)
    assert sink.pieces == [b"data: early\n\n"]


async def test_a_cut_mid_body_is_one_failure_to_the_sink() -> None:
    connection, _, lost = _connection()
    waiter = connection.send(REQUEST, None, head_only=False)
    connection.data_received(HEAD + chunk(b"data: a\n\n"))
    await asyncio.wait_for(waiter, 5)
    sink = Sink()
    connection.attach(sink)
    connection.connection_lost(ConnectionResetError())
    assert sink.failure is not None
    assert sink.failure.reason is Reason.STREAM_CUT
    assert not sink.ended
    assert not connection.complete
    assert lost == [connection]


async def test_a_close_before_the_head_fails_the_wait() -> None:
    connection, _, _ = _connection()
    waiter = connection.send(REQUEST, None, head_only=False)
    connection.connection_lost(None)
    with pytest.raises(UpstreamFailure):
        await asyncio.wait_for(waiter, 5)


async def test_a_byte_while_no_request_waits_closes_the_connection() -> None:
    connection, transport, _ = _connection()
    connection.data_received(b"HTTP/1.1 200 OK\r\n")
    assert transport.closing
    assert not connection.reusable


async def test_a_second_response_behind_the_first_is_not_reused() -> None:
    connection, transport, _ = _connection()
    waiter = connection.send(REQUEST, None, head_only=False)
    whole = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    connection.data_received(whole + whole)
    await asyncio.wait_for(waiter, 5)
    sink = Sink()
    connection.attach(sink)
    assert sink.pieces == [b"ok"]
    assert sink.ended
    assert not connection.reusable
    assert transport.closing


async def test_pause_and_resume_reach_the_transport() -> None:
    connection, transport, _ = _connection()
    connection.pause_reading()
    assert not transport.reading
    connection.resume_reading()
    assert transport.reading


# ---- the response's states, one test per move ----------------------------------------------------


async def test_a_response_moves_idle_waiting_body_done_and_waiting_again_on_reuse() -> None:
    connection, _, _ = _connection()
    assert connection.response is Response.IDLE
    waiter = connection.send(REQUEST, None, head_only=False)
    assert connection.response is Response.WAITING
    connection.data_received(HEAD)
    assert connection.response is Response.BODY
    await asyncio.wait_for(waiter, 5)
    connection.attach(Sink())
    connection.data_received(b"0\r\n\r\n")
    assert connection.response is Response.DONE
    connection.detach()
    connection.send(REQUEST, None, head_only=False)
    assert connection.response is Response.WAITING


async def test_an_interim_head_is_its_own_state_and_the_real_head_follows() -> None:
    connection, _, _ = _connection()
    waiter = connection.send(REQUEST, None, head_only=False)
    connection.data_received(b"HTTP/1.1 100 Continue\r\n")
    connection.data_received(b"\r\n")
    assert connection.response is Response.WAITING  # (its empty message ended with its head)
    connection.data_received(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n")
    connection.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    head = await asyncio.wait_for(waiter, 5)
    assert head.status == 200
    assert "Link" not in head.headers  # (the interim's headers are not the response's)
    assert connection.response is Response.DONE


async def test_a_close_while_interim_fails_the_wait() -> None:
    connection, _, _ = _connection()
    waiter = connection.send(REQUEST, None, head_only=False)
    connection.response = Response.INTERIM  # (llhttp ends a 1xx within the read: only a hand can stop it here)
    connection.connection_lost(None)
    assert connection.response is Response.FAILED
    with pytest.raises(UpstreamFailure):
        await asyncio.wait_for(waiter, 5)


async def test_a_close_before_the_head_is_failed_and_never_sent_again() -> None:
    connection, _, _ = _connection()
    waiter = connection.send(REQUEST, None, head_only=False)
    connection.connection_lost(None)
    assert connection.response is Response.FAILED
    with pytest.raises(UpstreamFailure):
        await waiter
    with pytest.raises(AssertionError):
        connection.send(REQUEST, None, head_only=False)


async def test_a_cut_body_is_failed_once_and_a_late_byte_only_closes() -> None:
    connection, transport, _ = _connection()
    waiter = connection.send(REQUEST, None, head_only=False)
    connection.data_received(HEAD + b"zz\r\n")  # (not a chunk size)
    await asyncio.wait_for(waiter, 5)
    assert connection.response is Response.FAILED
    assert transport.closing
    sink = Sink()
    connection.attach(sink)
    assert sink.failure is not None
    assert sink.failure.reason is Reason.BAD_UPSTREAM_RESPONSE
    transport.closing = False
    connection.data_received(b"more")
    assert connection.response is Response.FAILED
    assert transport.closing


async def test_a_whole_response_stays_done_after_the_close_and_a_late_sink_hears_the_end() -> None:
    connection, _, _ = _connection()
    waiter = connection.send(REQUEST, None, head_only=False)
    connection.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    await asyncio.wait_for(waiter, 5)
    connection.connection_lost(None)
    assert connection.response is Response.DONE
    assert not connection.complete  # (but not reusable: the transport is gone)
    sink = Sink()
    connection.attach(sink)
    assert sink.pieces == [b"ok"]
    assert sink.ended


async def test_a_body_framed_by_the_close_is_done_at_the_close() -> None:
    connection, _, _ = _connection()
    waiter = connection.send(REQUEST, None, head_only=False)
    connection.data_received(b"HTTP/1.1 200 OK\r\n\r\nabc")
    await asyncio.wait_for(waiter, 5)
    assert connection.response is Response.BODY
    sink = Sink()
    connection.attach(sink)
    connection.connection_lost(None)
    assert connection.response is Response.DONE
    assert sink.ended
    assert not connection.reusable


async def test_a_head_request_is_done_at_its_head() -> None:
    connection, _, _ = _connection()
    waiter = connection.send(REQUEST, None, head_only=True)
    connection.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n")
    await asyncio.wait_for(waiter, 5)
    assert connection.response is Response.DONE
    assert not connection.reusable


async def test_a_send_while_a_response_is_under_way_is_refused() -> None:
    connection, _, _ = _connection()
    connection.send(REQUEST, None, head_only=False)
    connection.data_received(HEAD)
    assert connection.response is Response.BODY
    with pytest.raises(AssertionError):
        connection.send(REQUEST, None, head_only=False)


def _alive(cls: type) -> int:
    """How many objects of exactly `cls` exist (the GC's list; a compiled class takes no weak reference)."""
    return sum(1 for obj in gc.get_objects() if type(obj) is cls)


async def test_a_lost_connection_is_freed_by_refcounting_not_left_to_the_cyclic_gc() -> None:
    """A closed upstream connection (a cancelled stream's, say) is freed at once, parser and all."""
    lost: list[UpstreamConnection] = []
    connection = UpstreamConnection(lost.append)
    connection.connection_made(FakeTransport())
    waiter = connection.send(REQUEST, None, head_only=False)
    connection.data_received(HEAD + chunk(b"data: a\n\n"))
    await asyncio.wait_for(waiter, 5)
    connection.attach(Sink())
    gc.disable()
    try:
        before = _alive(UpstreamConnection)
        connection.connection_lost(ConnectionResetError())
        lost.clear()
        del connection, waiter
        assert _alive(UpstreamConnection) == before - 1  # freed at once, with the collector off
    finally:
        gc.enable()
