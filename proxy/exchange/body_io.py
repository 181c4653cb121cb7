"""Whole (non-SSE) responses: judge JSON bodies the dialect expects, stream everything else through.

A JSON body that the dialect expects is read (bounded) so that `judge_body` can catch a `null` 200,
an error hidden in a 2xx, a batch with missing choices or an HTML error page, and answer in the
dialect's shape. Anything else (downloads, the backend's own /metrics, compressed bodies, bodies
larger than the bound) is copied through chunk by chunk, so memory stays flat. A read that breaks
or stalls is raised as an `UpstreamFailure` (the handler's lifecycle decides what it means); a
write that fails is raised as the client's.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from proxy.core.body import judge_body
from proxy.core.dialects import Dialect, RequestInfo
from proxy.core.headers import response_headers
from proxy.core.lifecycle import Lifecycle, Reason
from proxy.core.record import ExchangeRecord
from proxy.exchange.client_io import ClientWriter
from proxy.exchange.failures import READ_ERRORS, body_failure

__all__ = ["respond_whole"]

_CHUNK = 64 * 1024


def _judged(method: str, upstream: aiohttp.ClientResponse, dialect: Dialect) -> bool:
    """Whether this body is one the proxy must read and check before passing it on."""
    if not dialect.json_body or method == "HEAD" or upstream.status in (204, 304):
        return False
    encoding = upstream.headers.get("Content-Encoding", "identity").lower()
    return encoding == "identity"


async def _read(reader: aiohttp.StreamReader, size: int, idle: float) -> bytes:
    """One read, bounded by the idle timeout; a stall or a cut raises `UpstreamFailure`."""
    try:
        async with asyncio.timeout(idle):
            return await reader.read(size)
    except TimeoutError:
        raise body_failure(None, idle) from None
    except READ_ERRORS as exc:
        raise body_failure(exc, idle) from exc


async def read_bounded(upstream: aiohttp.ClientResponse, limit: int, idle: float) -> tuple[bytes, bool]:
    """Up to `limit` bytes of the body; the flag tells whether the whole body fits."""
    chunks: list[bytes] = []
    size = 0
    while size <= limit:
        chunk = await _read(upstream.content, -1, idle)
        if not chunk:
            return b"".join(chunks), True
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), False


def plain_verdict(status: int) -> Reason:
    if status >= 500:
        return Reason.UPSTREAM_5XX
    if status >= 400:
        return Reason.UPSTREAM_4XX
    return Reason.COMPLETE


async def respond_whole(
    upstream: aiohttp.ClientResponse,
    out: ClientWriter,
    life: Lifecycle,
    ex: ExchangeRecord,
    dialect: Dialect,
    info: RequestInfo,
    *,
    max_body_size: int,
    idle_timeout: float,
) -> web.StreamResponse:
    head = b""
    verdict = plain_verdict(upstream.status)
    if _judged(ex.method, upstream, dialect):
        head, whole = await read_bounded(upstream, max_body_size, idle_timeout)
        if whole:  # a body beyond --max-body-size is passed on unjudged
            judged = judge_body(dialect, info, upstream.status, upstream.headers.get("Content-Type"), head)
            verdict = Reason(judged.reason)
            ex.record_usage(judged.usage)
            ex.upstream_message = judged.upstream_message
            life.body_ended(verdict)
            if judged.replacement is not None:
                status, body = judged.replacement
                headers = response_headers(upstream.headers, body_rewritten=True)
                headers["X-Request-Id"] = ex.request_id
                return out.whole(status, body, headers)
            # Read whole and judged good (or passed as the upstream's own error): one response that
            # aiohttp writes in one go, headers and body together, rather than a copy in pieces.
            headers = response_headers(upstream.headers, body_rewritten=False)
            headers.popall("Content-Length", None)
            headers["X-Request-Id"] = ex.request_id
            return out.whole(upstream.status, head, headers, reason=upstream.reason, content_type=None)
    return await _copy_through(upstream, out, life, ex, head, verdict, idle_timeout)


async def _copy_through(
    upstream: aiohttp.ClientResponse,
    out: ClientWriter,
    life: Lifecycle,
    ex: ExchangeRecord,
    head: bytes,
    verdict: Reason,
    idle: float,
) -> web.StreamResponse:
    """Status, headers and body as the upstream sent them, `head` (already read) first.

    `verdict` is the reason if the copy completes; a broken upstream or client raises instead.
    """
    headers = response_headers(upstream.headers, body_rewritten=False)
    headers["X-Request-Id"] = ex.request_id
    response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
    if upstream.content_length is not None:
        response.content_length = upstream.content_length
    await out.commit(response)
    if head:
        await out.write(head)
    while chunk := await _read(upstream.content, _CHUNK, idle):
        await out.write(chunk)
    life.body_ended(verdict)
    return response
