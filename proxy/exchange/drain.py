"""`--on-abandon drain`: after the client left, read the upstream's answer to its end for its usage.

For operators who must bill every token. It runs as its own kept-referenced task, so that the
handler (cancelled by its connection when the client leaves) simply unwinds; the drain owns the upstream
connection, is still bounded by --first-byte-timeout and --idle-timeout, writes nothing anywhere,
closes the upstream and then writes the exchange's books. The outcome stays `aborted`. Cancelling
is the default and the cheaper choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from proxy.core.body import judge_body
from proxy.core.dialects import Dialect, RequestInfo
from proxy.core.guard import StreamGuard
from proxy.core.record import ExchangeRecord
from proxy.exchange.errors import UpstreamFailure
from proxy.exchange.stream import count_stream, is_stream
from proxy.exchange.upstream import BodyReader, UpstreamHead, UpstreamLink, UpstreamPool

__all__ = ["drain"]


async def drain(
    answer: Awaitable[tuple[UpstreamLink, UpstreamHead]],
    pool: UpstreamPool,
    ex: ExchangeRecord,
    dialect: Dialect,
    info: RequestInfo,
    *,
    guard: StreamGuard | None,
    reader: BodyReader | None,
    first_byte_timeout: float,
    idle_timeout: float,
    max_body_size: int,
    max_event_size: int,
    finish: Callable[[], None],
) -> None:
    """Wait for the upstream's answer (if it has not come yet), read it through, then `finish`."""
    link: UpstreamLink | None = None
    try:
        async with asyncio.timeout(first_byte_timeout):
            link, head = await answer
        ex.upstream_status = head.status
        if reader is None:
            reader = BodyReader(link)  # (a stream's relay is done with the connection: this takes over)
        link.resume_reading()
        if is_stream(head):
            if guard is None:  # the client left before the stream began
                guard = StreamGuard(dialect, hold=False, max_event_size=max_event_size)
            try:
                while not guard.done and (piece := await reader.read(idle_timeout)):
                    guard.feed(piece)
            except UpstreamFailure:
                pass  # stalled or cut: the guard counts what it saw
            guard.end_of_stream()
            count_stream(guard, ex)
        else:
            pieces: list[bytes] = []
            size = 0
            while size <= max_body_size and (piece := await reader.read(idle_timeout)):
                pieces.append(piece)
                size += len(piece)
            if reader.at_eof and size <= max_body_size:
                content_type = head.headers.get("Content-Type")
                ex.record_usage(judge_body(dialect, info, head.status, content_type, b"".join(pieces)).usage)
    except (TimeoutError, UpstreamFailure):
        pass  # nothing more to learn: the books take what was read
    finally:
        if link is not None:
            pool.close_link(link)
        finish()
