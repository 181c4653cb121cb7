"""What a cancelled handler does: unwind, finish its reply (shutdown), or drain the upstream.

aiohttp cancels the handler when its client leaves, and the server cancels it at the end of a
shutdown drain (after setting `Exchange.interrupt`). `--on-abandon drain` is for operators who must
bill every token: after the client left, the upstream's answer is read to its end (still bounded by
--first-byte-timeout and --idle-timeout, and never written anywhere), its usage recorded, and the
outcome stays `aborted`. Cancelling is the default and the cheaper choice.
"""

from __future__ import annotations

import asyncio

import aiohttp

from .body import judge_body
from .body_io import read_bounded
from .dialects import Dialect, RequestInfo
from .errors import StreamBroken
from .exchange import Exchange
from .guard import StreamGuard

__all__ = ["absorb_cancellation", "drain_stream", "drain_whole", "start_drain"]

_READ_ERRORS = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, OSError, TimeoutError)


def absorb_cancellation() -> bool:
    """Take back the one cancellation that interrupted this task, so that it can finish its reply.

    False, and nothing taken back, when more than one is pending: then the task must just unwind.
    """
    task = asyncio.current_task()
    if task is None or task.cancelling() != 1:
        return False
    task.uncancel()
    return True


def start_drain(ex: Exchange, on_abandon: str) -> bool:
    """Whether to read the upstream on after this cancellation, which is then absorbed.

    True when the client left (not a shutdown) and --on-abandon is `drain`; the exchange is then
    booked as aborted and drained. The caller drains, then re-raises the cancellation.
    """
    if on_abandon != "drain" or ex.interrupt is not None or not absorb_cancellation():
        return False
    ex.settle("aborted", "client_disconnect")
    ex.drained = True
    return True


async def drain_stream(reader: aiohttp.StreamReader, guard: StreamGuard, idle_timeout: float) -> None:
    """Feed the rest of the stream to the guard (for usage and counts) until it ends or stalls."""
    try:
        while not guard.done:
            async with asyncio.timeout(idle_timeout):
                chunk = await reader.readany()
            if not chunk:
                guard.end_of_stream()
                return
            guard.feed(chunk)
    except _READ_ERRORS:
        return


async def drain_whole(
    upstream: aiohttp.ClientResponse, dialect: Dialect, info: RequestInfo, ex: Exchange, limit: int, idle: float
) -> None:
    """Read a whole JSON body (bounded) just to take its usage."""
    try:
        body, whole = await read_bounded(upstream, limit, idle)
    except StreamBroken:
        return
    if whole:
        ex.record_usage(judge_body(dialect, info, upstream.status, upstream.headers.get("Content-Type"), body).usage)
