"""Whole (non-SSE) responses: judge JSON bodies the dialect expects, copy everything else through.

A JSON body that the dialect expects is read (bounded) so that `judge_body` can catch a `null` 200,
an error hidden in a 2xx, a batch with missing choices or an HTML error page, and answer in the
dialect's shape. Anything else (downloads, the backend's own /metrics, compressed bodies, bodies
larger than the bound) is copied through piece by piece, so memory stays flat. Each read waits at
most --idle-timeout for the next bytes (a body that trickles is not cut while it moves); a read
that breaks or stalls raises an `UpstreamFailure` (the handler's lifecycle decides what it means).

The exchange's verdict is taken once the response was handed to the client's socket to its last
byte: a client that leaves during it is an abort (`whole_body`), and shutdown during it cuts it.
"""

from __future__ import annotations

from proxy.core.body import TAIL_BYTES, judge_body, usage_from_tail
from proxy.core.dialects import Dialect, RequestInfo
from proxy.core.headers import response_headers
from proxy.core.lifecycle import Answer, Lifecycle, reason_for_status
from proxy.core.record import ExchangeRecord
from proxy.exchange.client_writer import ClientWriter, ResponseHead
from proxy.exchange.errors import Cause, Interrupted, Interrupter, told
from proxy.exchange.reply import carry_out, write_error
from proxy.exchange.upstream import BodyReader, UpstreamHead

__all__ = ["JUDGE_PREFIX", "read_bounded", "respond_whole"]

JUDGE_PREFIX = 4 * 1024 * 1024  # nginx relays a body through 4 MiB of buffers at most


def _judged(method: str, head: UpstreamHead, dialect: Dialect) -> bool:
    """Whether this body is one the proxy must read and check before passing it on."""
    if not dialect.json_body or method == "HEAD" or head.status in (204, 304):
        return False
    encoding = head.headers.get("Content-Encoding", "identity").lower()
    return encoding == "identity"


async def read_bounded(reader: BodyReader, limit: int, idle: float) -> tuple[bytes, bool]:
    """Up to `limit` bytes of the body (a little more: whole reads); the flag tells whether it is all."""
    pieces: list[bytes] = []
    size = 0
    while size <= limit:
        piece = reader.read_now()
        if piece is None:
            piece = await reader.read(idle)
        if not piece:
            return b"".join(pieces), True
        pieces.append(piece)
        size += len(piece)
    return b"".join(pieces), False


async def respond_whole(
    reader: BodyReader,
    head: UpstreamHead,
    out: ClientWriter,
    life: Lifecycle,
    ex: ExchangeRecord,
    dialect: Dialect,
    info: RequestInfo,
    interrupter: Interrupter,
    *,
    max_body_size: int,
    idle_timeout: float,
) -> Answer | None:
    """Relay (or judge, then answer) a whole body; the lifecycle's answer to its end for the handler."""
    interrupter.watch(lambda cause: reader.interrupt(Interrupted(cause)))
    prefix = b""
    verdict = reason_for_status(head.status)
    checked = _judged(ex.method, head, dialect)
    if checked:
        # A batch's choices can only be counted whole (bounded by --max-body-size); everything else
        # worth judging (an empty or null body, an error in a 2xx) is small, so a body past
        # JUDGE_PREFIX is relayed as it comes, in bounded memory.
        limit = max_body_size if dialect.name == "completions" else min(max_body_size, JUDGE_PREFIX)
        prefix, whole = await read_bounded(reader, limit, idle_timeout)
        if whole:
            judged = judge_body(dialect, info, head.status, head.headers.get("Content-Type"), prefix)
            verdict = judged.reason
            ex.record_usage(judged.usage)
            ex.upstream_message = judged.upstream_message
            if judged.replacement is not None:
                status, body = judged.replacement
                headers = response_headers(head.headers, body_rewritten=True)
                write_error(out, status, body, headers)  # the dialect's error, worded by the judge
            else:
                # Read whole and judged good (or passed as the upstream's own error): headers and
                # body in one go, rather than a copy in pieces.
                body, headers = prefix, response_headers(head.headers, body_rewritten=False)
                headers.popall("Content-Length", None)
                out.whole_now(head.status, body, headers, reason=head.reason or None, content_type=None)
            _cut_on_shutdown(interrupter, life, out, dialect)
            if out.paused:
                await out.drained()
            return life.body_ended(verdict)
    tail = checked and 200 <= head.status < 300  # its usage is read from its end
    await _copy_through(reader, head, out, life, ex, prefix, idle_timeout, interrupter, dialect, keep_tail=tail)
    if tail:
        ex.record_usage(usage_from_tail(dialect, reader.tail))
    return life.body_ended(verdict)


async def _copy_through(
    reader: BodyReader,
    head: UpstreamHead,
    out: ClientWriter,
    life: Lifecycle,
    ex: ExchangeRecord,
    prefix: bytes,
    idle: float,
    interrupter: Interrupter,
    dialect: Dialect,
    *,
    keep_tail: bool,
) -> None:
    """Status, headers and body as the upstream sent them, `prefix` (already read) first; a broken
    upstream or client raises. With `keep_tail`, the reader keeps the body's last bytes."""
    headers = response_headers(head.headers, body_rewritten=False)
    await out.commit(ResponseHead(head.status, headers, reason=head.reason or None, content_length=head.content_length))
    _cut_on_shutdown(interrupter, life, out, dialect)
    if prefix:
        await out.write(prefix)
    if keep_tail:
        reader.keep_tail(prefix, TAIL_BYTES)
    while piece := await reader.read(idle):
        await out.write(piece)
    await out.finish()


def _cut_on_shutdown(interrupter: Interrupter, life: Lifecycle, out: ClientWriter, dialect: Dialect) -> None:
    """Once the client has the status line, shutdown's end of the drain time ends the response: the
    lifecycle's answer (a cut: a plain body cannot carry a second response) is carried out at once."""

    def end(cause: Cause) -> None:
        carry_out(out, told(life, cause), dialect=dialect)

    interrupter.watch(end)
