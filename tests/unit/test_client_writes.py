"""A response's head and the first body bytes it already has go to the client's socket in one write."""

from __future__ import annotations

from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy

from proxy.core.lifecycle import Lifecycle
from proxy.core.record import ExchangeRecord
from proxy.exchange.client import ClientRequest
from proxy.exchange.client_writer import ClientWriter, ResponseHead

EVENT = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'


class _Transport:
    """Records each write: what the kernel would get as one system call."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return False


class _Channel:
    def __init__(self) -> None:
        self.transport: Any = _Transport()
        self.writing_paused = False
        self.flow_hooks = None

    async def drain(self) -> None:  # never paused here
        return

    def close_now(self) -> None:
        return

    def pause_reading(self) -> None:
        return

    def resume_reading(self) -> None:
        return


def _writer(version: tuple[int, int] = (1, 1), method: str = "POST") -> tuple[ClientWriter, _Channel, ExchangeRecord]:
    channel = _Channel()
    request = ClientRequest(channel, method, "/v1/chat/completions", "/v1/chat/completions", version,
                            CIMultiDictProxy(CIMultiDict()), remote="127.0.0.1", keep_alive=True)  # fmt: skip
    ex = ExchangeRecord("rid", method, "/v1/chat/completions", "chat_completions", "127.0.0.1")
    return ClientWriter(request, ex, Lifecycle(ex), 5.0), channel, ex


def test_the_head_and_the_first_events_go_out_in_one_write() -> None:
    out, channel, ex = _writer()
    out.commit_now(ResponseHead(200, {"Content-Type": "text/event-stream"}), hold=True)
    assert channel.transport.writes == []  # held for the first body bytes
    assert out.write_raw(EVENT)
    out.flush_head()  # nothing left to flush
    [write] = channel.transport.writes
    head, _, body = write.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Transfer-Encoding: chunked" in head
    assert body == b"%x\r\n%b\r\n" % (len(EVENT), EVENT)  # framed like any later piece
    assert ex.bytes_out == len(EVENT)
    assert out.write_raw(EVENT)  # the next piece: its own write, framed the same way
    assert channel.transport.writes[1] == body


def test_a_head_request_gets_the_head_alone() -> None:
    out, channel, _ex = _writer(method="HEAD")
    out.commit_now(ResponseHead(200, {"Content-Type": "text/event-stream"}), hold=True)
    assert out.write_raw(EVENT)
    [write] = channel.transport.writes
    assert write.endswith(b"\r\n\r\n")
    assert EVENT not in write


def test_a_held_head_with_no_body_bytes_goes_out_at_the_flush() -> None:
    out, channel, _ex = _writer()
    out.commit_now(ResponseHead(200, {"Content-Type": "text/event-stream"}), hold=True)
    out.flush_head()
    [write] = channel.transport.writes
    assert write.startswith(b"HTTP/1.1 200 OK\r\n")
    assert write.endswith(b"\r\n\r\n")
    out.flush_head()
    assert len(channel.transport.writes) == 1  # once only


async def test_the_end_of_the_body_carries_a_held_head() -> None:
    out, channel, _ex = _writer()
    out.commit_now(ResponseHead(200, {"Content-Type": "text/event-stream"}), hold=True)
    await out.finish()
    [write] = channel.transport.writes
    assert write.startswith(b"HTTP/1.1 200 OK\r\n")
    assert write.endswith(b"\r\n\r\n0\r\n\r\n")


async def test_the_last_chunk_goes_out_once() -> None:
    """A relayed chunked body ends in `finish`, and the exchange's settling calls it again."""
    out, channel, _ex = _writer()
    await out.commit(ResponseHead(200, {"Content-Type": "application/octet-stream"}))
    await out.write(EVENT)
    await out.finish()
    await out.finish()
    assert b"".join(channel.transport.writes).count(b"0\r\n\r\n") == 1
