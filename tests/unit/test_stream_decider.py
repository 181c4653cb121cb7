"""The lifecycle decides what a streamed exchange's client is told, and the relay carries it out.

One case, with the repo's own classes over fake sockets: the guard commits at the first
content, shutdown comes while the status line is still to be sent. The lifecycle must not answer
STATUS (the writer has not sent the head) while the guard, from a flag of its own, writes a 200,
the content and the shutdown frame. The exchange is committed once the 200 is due: the lifecycle
answers FRAME, and that is what the client gets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from multidict import CIMultiDict
from support.fake_io import Exchange, chat_chunk

from proxy.core.lifecycle import Reason, Reply
from proxy.exchange.errors import Cause, Interrupter
from proxy.exchange.stream import relay_stream
from proxy.exchange.upstream import UpstreamHead

SSE_HEAD = UpstreamHead(200, "OK", CIMultiDict({"Content-Type": "text/event-stream"}), None)


async def _until(condition: Callable[[], bool], task: asyncio.Task[None]) -> None:
    """Let the loop run until `condition` holds (each turn is a step of the task: no clock)."""
    async with asyncio.timeout(5):
        while not condition():
            assert not task.done(), task
            await asyncio.sleep(0)



async def test_shutdown_while_the_status_line_is_due_gets_the_reply_the_lifecycle_chose() -> None:
    x = Exchange(hold=5.0)
    interrupter = Interrupter()
    task = asyncio.create_task(relay_stream(x.link, SSE_HEAD, x.guard, x.out, x.life, x.ex, x.cfg, interrupter))
    await _until(lambda: x.link.sink is not None, task)
    x.sink.body(chat_chunk("Hello"))  # the guard commits at the first content: the relay asks for the 200
    interrupter.fire()  # shutdown, before the handler has woken to send the status line
    async with asyncio.timeout(5):
        await task
    assert x.life.ended is not None
    assert x.life.ended.reason is Reason.SHUTDOWN
    assert x.life.ended.reply is Reply.FRAME
    sent = x.sent
    assert sent.startswith(b"HTTP/1.1 200 "), sent
    body = sent.partition(b"\r\n\r\n")[2]
    assert body.index(b"Hello") < body.index(b'"code":"shutdown"') < body.index(b"data: [DONE]")
    assert body.endswith(b"0\r\n\r\n")
    assert x.ex.status == 200


async def test_a_departure_is_an_event_carried_out_at_once_not_a_cancel() -> None:
    x = Exchange(hold=0.0)
    interrupter = Interrupter()
    x.request.on_departure(lambda: interrupter.fire(Cause.CLIENT_GONE))
    task = asyncio.create_task(relay_stream(x.link, SSE_HEAD, x.guard, x.out, x.life, x.ex, x.cfg, interrupter))
    await _until(lambda: x.link.sink is not None, task)
    x.sink.body(chat_chunk("Hello"))
    x.request.depart()  # what the connection does in connection_lost
    transport = x.channel.transport
    assert transport is not None
    assert transport.aborted  # carried out in the same callback: the socket is dropped
    assert x.life.ended is not None
    assert (x.life.ended.reason, x.life.ended.cancel) == (Reason.CLIENT_DISCONNECT, "client_disconnect")
    async with asyncio.timeout(5):
        await task  # the handler's wait ends normally: nothing was cancelled
    assert not task.cancelled()


def test_a_departure_before_the_exchange_listens_is_told_when_it_does() -> None:
    x = Exchange()
    x.request.depart()
    heard: list[bool] = []
    x.request.on_departure(lambda: heard.append(True))
    assert heard == [True]
