"""The lifecycle decides what a streamed exchange's client is told, and the relay carries it out.

Issue 28's repro, with the repo's own classes over fake sockets: the guard commits at the first
content, shutdown comes while the status line is still to be sent; the lifecycle answers STATUS
(nothing was committed), so the client must get that status, not a 200 with a shutdown frame.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from multidict import CIMultiDict
from support.fake_io import Exchange, chat_chunk

from proxy.core.lifecycle import Reason, Reply
from proxy.exchange.interrupts import Interrupter
from proxy.exchange.stream_io import relay_stream
from proxy.exchange.upstream import UpstreamHead

SSE_HEAD = UpstreamHead(200, "OK", CIMultiDict({"Content-Type": "text/event-stream"}), None)


async def _until(condition: Callable[[], bool], task: asyncio.Task[None]) -> None:
    """Let the loop run until `condition` holds (each turn is a step of the task: no clock)."""
    async with asyncio.timeout(5):
        while not condition():
            assert not task.done(), task
            await asyncio.sleep(0)


@pytest.mark.xfail(strict=True, reason="issue 28: the guard's own committed flag words the reply")
async def test_shutdown_while_the_status_line_is_due_gets_the_status_the_lifecycle_chose() -> None:
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
    assert x.life.ended.reply is Reply.STATUS
    sent = x.sent
    assert sent.startswith(b"HTTP/1.1 503 "), sent
    assert b"Hello" not in sent
    assert b"[DONE]" not in sent
    assert x.ex.status == 503
