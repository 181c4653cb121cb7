"""Whole (non-SSE) responses: judge JSON bodies the dialect expects, stream everything else through.

A JSON body that the dialect expects is read (bounded) so that `judge_body` can catch a `null` 200,
an error hidden in a 2xx, a batch with missing choices or an HTML error page, and answer in the
dialect's shape. Anything else (downloads, the backend's own /metrics, compressed bodies, bodies
larger than the bound) is copied through chunk by chunk, so memory stays flat.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from .body import judge_body
from .client_io import ClientStalled, ClientWriter
from .dialects import Dialect, RequestInfo
from .errors import StreamBroken
from .exchange import Exchange
from .headers import response_headers
from .state import ProxyState

__all__ = ["read_bounded", "respond_whole"]

_CHUNK = 64 * 1024
_READ_ERRORS = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, OSError)


def _judged(request: web.BaseRequest, upstream: aiohttp.ClientResponse, dialect: Dialect) -> bool:
    """Whether this body is one the proxy must read and check before passing it on."""
    if not dialect.json_body or request.method == "HEAD" or upstream.status in (204, 304):
        return False
    encoding = upstream.headers.get("Content-Encoding", "identity").lower()
    return encoding == "identity"


async def read_bounded(upstream: aiohttp.ClientResponse, limit: int, idle: float) -> tuple[bytes, bool]:
    """Up to `limit` bytes of the body; the flag tells whether the whole body fits."""
    chunks: list[bytes] = []
    size = 0
    reader = upstream.content
    try:
        while size <= limit:
            async with asyncio.timeout(idle):
                chunk = await reader.readany()
            if not chunk:
                return b"".join(chunks), True
            chunks.append(chunk)
            size += len(chunk)
    except _READ_ERRORS as exc:
        raise StreamBroken() from exc
    except TimeoutError as exc:
        raise StreamBroken(f"the upstream body stalled for {idle:g} s") from exc
    return b"".join(chunks), False


async def respond_whole(
    request: web.BaseRequest,
    upstream: aiohttp.ClientResponse,
    state: ProxyState,
    dialect: Dialect,
    info: RequestInfo,
    ex: Exchange,
) -> web.StreamResponse:
    cfg = state.config
    head = b""
    verdict = _plain_verdict(upstream.status)
    if _judged(request, upstream, dialect):
        head, whole = await read_bounded(upstream, cfg.max_body_size, cfg.idle_timeout)
        if whole:  # a body beyond --max-body-size is passed on unjudged
            judged = judge_body(dialect, info, upstream.status, upstream.headers.get("Content-Type"), head)
            verdict = judged.outcome, judged.reason
            ex.record_usage(judged.usage)
            if judged.replacement is not None:
                ex.settle(*verdict)
                status, body = judged.replacement
                headers = response_headers(upstream.headers, body_rewritten=True)
                headers["X-Request-Id"] = ex.request_id
                ex.status = status
                ex.bytes_out = len(body)
                return web.Response(status=status, body=body, content_type="application/json", headers=headers)
    return await _copy_through(request, upstream, state, ex, head, verdict)


def _plain_verdict(status: int) -> tuple[str, str]:
    if status >= 500:
        return "error", "upstream_5xx"
    if status >= 400:
        return "error", "upstream_4xx"
    return "ok", "complete"


async def _copy_through(
    request: web.BaseRequest,
    upstream: aiohttp.ClientResponse,
    state: ProxyState,
    ex: Exchange,
    head: bytes,
    verdict: tuple[str, str],
) -> web.StreamResponse:
    """Status, headers and body as the upstream sent them, `head` (already read) first.

    `verdict` is the outcome if the copy completes; a broken upstream or client overrides it.
    """
    cfg = state.config
    headers = response_headers(upstream.headers, body_rewritten=False)
    headers["X-Request-Id"] = ex.request_id
    response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
    if upstream.content_length is not None:
        response.content_length = upstream.content_length
    out = ClientWriter(request, response, ex, cfg.client_stall_timeout)
    try:
        await out.commit()
        if head:
            await out.write(head)
        reader = upstream.content
        while True:
            try:
                async with asyncio.timeout(cfg.idle_timeout):
                    chunk = await reader.read(_CHUNK)
            except (*_READ_ERRORS, TimeoutError):
                # Nothing in HTTP/1.1 can tell the client that a plain body broke except a cut.
                ex.settle("error", "stream_cut")
                out.abort()
                break
            if not chunk:
                ex.settle(*verdict)
                break
            await out.write(chunk)
    except (ClientStalled, ConnectionError) as exc:
        reason = "client_stalled" if isinstance(exc, ClientStalled) else "client_disconnect"
        ex.settle("aborted", reason)
        ex.cancelled(reason)
        out.abort()
    return response
