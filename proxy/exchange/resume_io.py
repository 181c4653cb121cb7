"""--resume-on-cut's I/O: after the guard asked for a continuation, send it and hand back its stream.

The deciding is the core's (`proxy.core.resume`): the guard asks its `Resumer` where a committed
stream would end with an error, and a yes comes here as a step with `resume`. `Resuming.carry_on`
waits what a stray block's `Retry-After` asked (shutdown ends the wait), sends the continuation on
the same upstream with the client's headers, and returns the new response once it answers with a
stream; a continuation answered with a retryable status is tried again while the budget lasts; any
other answer, or none, returns None, and the stream ends as it would have without the flag. Where
the core cannot count the tokens so far from the stream, the backend's `/tokenize` is asked first
(`count_tokens`: bounded in time and size); no count, no continuation where the client set a budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from multidict import CIMultiDict

from proxy.core.guard import StreamGuard
from proxy.core.resume import RETRYABLE_STATUSES, Resumer
from proxy.core.resume.count import TOKENIZE_PATH
from proxy.core.resume.rules import retry_delay
from proxy.core.verdicts import Reason
from proxy.exchange.errors import Interrupter, UpstreamFailure
from proxy.exchange.upstream import BodyReader, UpstreamHead, UpstreamLink, UpstreamPool

__all__ = [
    "ContinuationFailed", "Resuming", "TokenizeFailed", "continuation_headers", "count_tokens", "open_continuation",
    "with_keepalives",
]

T = TypeVar("T")


class ContinuationFailed(Exception):
    """The continuation was answered with something other than a stream, or not at all."""

    def __init__(self, message: str, status: int = 502, retry_after: str | None = None) -> None:
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


class TokenizeFailed(Exception):
    """`/tokenize` gave no answer to read: none in time, a broken one, or one past its size limit."""


async def count_tokens(
    pool: UpstreamPool, headers: CIMultiDict[str], body: bytes, limit: int, *, within: float,
    interrupter: Interrupter,
) -> tuple[int, bytes]:
    """POST `body` to the upstream's `/tokenize`: its status and body (at most `limit` bytes), all
    within `within` seconds; TokenizeFailed otherwise. What the answer means is the core's."""
    link: UpstreamLink | None = None
    try:
        async with asyncio.timeout(within) as deadline:
            interrupter.watch_deadline(deadline)
            link, head = await pool.request("POST", TOKENIZE_PATH, headers, body)
            if head.content_length is not None and head.content_length > limit:
                raise TokenizeFailed(f"/tokenize answered {head.content_length} bytes, past {limit}")
            reader = BodyReader(link)
            parts, size = [], 0
            while data := await reader.read(within):
                size += len(data)
                if size > limit:
                    raise TokenizeFailed(f"/tokenize answered more than {limit} bytes")
                parts.append(data)
    except TimeoutError as exc:
        if interrupter.fired:
            raise interrupter.error() from exc
        raise TokenizeFailed(f"/tokenize did not answer within {within:g} s") from None
    except UpstreamFailure as failure:  # (its own name: compiled, a reused except name keeps its first type)
        raise TokenizeFailed(f"/tokenize: {failure.message}") from failure
    finally:
        if link is not None:
            if link.complete:
                pool.release(link)
            else:
                pool.close_link(link)
    return head.status, b"".join(parts)


def continuation_headers(headers: CIMultiDict[str]) -> CIMultiDict[str]:
    """The client's request headers as sent upstream, for a body the proxy wrote (plain JSON)."""
    copy = CIMultiDict(headers)
    for name in ("Content-Length", "Content-Encoding", "Transfer-Encoding", "Expect"):
        copy.popall(name, None)
    copy["Content-Type"] = "application/json"
    return copy


async def open_continuation(
    pool: UpstreamPool, target: str, headers: CIMultiDict[str], body: bytes, *,
    first_byte_timeout: float, interrupter: Interrupter,
) -> tuple[UpstreamLink, UpstreamHead]:
    """POST the continuation; its link and head when it is a 2xx event stream, else ContinuationFailed."""
    try:
        async with asyncio.timeout(first_byte_timeout) as deadline:
            interrupter.watch_deadline(deadline)
            link, head = await pool.request("POST", target, headers, body)
    except TimeoutError as exc:
        if interrupter.fired:
            raise interrupter.error() from exc
        raise ContinuationFailed(f"the upstream sent no response headers within {first_byte_timeout:g} s") from None
    except UpstreamFailure as failure:
        raise ContinuationFailed(failure.message) from failure
    content_type = head.headers.get("Content-Type", "")
    if 200 <= head.status < 300 and content_type.startswith("text/event-stream"):
        return link, head
    pool.close_link(link)
    status, retry_after = head.status, head.headers.get("Retry-After")
    raise ContinuationFailed(f"the continuation was answered with status {status}", status, retry_after)


async def with_keepalives(work: Awaitable[T], keepalive: Callable[[], Awaitable[bool]], interval: float) -> T:
    """`work`'s result; meanwhile a keep-alive comment every `interval` seconds (0: none), as while
    the upstream is silent, so that the client and the load balancers in between keep the stream.
    A failing write (the client left or stalled) is raised, and the work is cancelled."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=interval or None)
            if done:
                return task.result()
            await keepalive()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


@dataclass(slots=True)
class Resuming:
    """What one exchange needs to continue its stream: the decisions, and a way to reach the upstream."""

    resumer: Resumer
    reopen: Callable[[bytes], Awaitable[UpstreamLink]]  # send a body, get a stream's link (or raise)
    tokenize: Callable[[bytes, int], Awaitable[tuple[int, bytes]]]  # `count_tokens` on this upstream
    interrupter: Interrupter
    first_byte_timeout: float  # the longest Retry-After honoured

    async def carry_on(self, guard: StreamGuard, reason: Reason) -> UpstreamLink | None:
        """The stream broke for `reason` and the guard asked to continue: the continuation's link,
        already handed to the guard (`resume`), or None (then the guard must `give_up()`).

        (Run it under `with_keepalives`: a wait for Retry-After or for a long prompt's first byte is
        upstream silence like any other.)"""
        resumer = self.resumer
        delay = retry_delay(guard.retry_after, self.first_byte_timeout, time.time())
        while True:
            if delay is None:
                resumer.withdraw("the upstream asked to retry later than --first-byte-timeout")
                return None
            if delay > 0:
                await self._wait(delay)
            if not await self._count():
                return None
            try:
                upstream = await self.reopen(resumer.body())
            except ContinuationFailed as exc:
                resumer.failed(str(exc))
                if exc.status not in RETRYABLE_STATUSES or not resumer.may_resume(reason, exc.status):
                    return None
                delay = retry_delay(exc.retry_after, self.first_byte_timeout, time.time())
                continue
            guard.resume(resumer.started().rewrite)
            return upstream

    async def _count(self) -> bool:
        """Where the core asks for it, the tokens so far counted by the backend's tokenizer first."""
        need = self.resumer.count_request()
        if need is None:
            return True
        try:
            status, answer = await self.tokenize(*need)
        except TokenizeFailed as exc:
            return self.resumer.uncounted(f"no tokenizer to count the answer so far: {exc}")
        return self.resumer.counted(status, answer)

    async def _wait(self, delay: float) -> None:
        """Sleep `delay` seconds; shutdown (the interrupter) ends the wait with Interrupted."""
        try:
            async with asyncio.timeout(delay) as deadline:
                self.interrupter.watch_deadline(deadline)
                await asyncio.Event().wait()
        except TimeoutError:
            pass
        if self.interrupter.fired:
            raise self.interrupter.error()
