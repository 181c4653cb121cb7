"""The main port's only handler: one exchange from the client's request to its recorded outcome.

Phases (design section 2): received -> awaiting headers -> responding -> finished. The upstream
response lives in one `try/finally` that closes it unless it was read to its end, so a client that
leaves (aiohttp cancels this handler: the server runs with `handler_cancellation=True`) or any
failure closes the upstream connection at once instead of returning it to the pool half-read.
"""

from __future__ import annotations

import asyncio
import uuid

from aiohttp import web
from yarl import URL

from .body_io import respond_whole
from .dialects import Dialect, RequestInfo, for_request, inspect_request
from .errors import BodyTooLarge, ProxyError, upstream_request_errors
from .exchange import Exchange, Phase
from .headers import request_headers
from .state import STATE, ProxyState
from .stream_io import pump_stream

__all__ = ["error_response", "handle"]

_REQUEST_ID = "X-Request-Id"
_NO_BODY_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE", "TRACE"})


def error_response(dialect: Dialect, status: int, message: str, code: str, request_id: str) -> web.Response:
    """A whole JSON error in the client's dialect (used before anything was sent)."""
    return web.Response(
        status=status,
        body=dialect.error_body(status, message, code),
        content_type="application/json",
        headers={_REQUEST_ID: request_id},
    )


async def handle(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    dialect = for_request(request.method, request.path)
    request_id = request.headers.get(_REQUEST_ID) or uuid.uuid4().hex
    ex = Exchange(request_id, request.method, request.path, dialect.name, request.remote)
    task = asyncio.current_task()
    assert task is not None
    state.recorder.start(ex)
    state.track(task, ex)
    try:
        if state.draining:
            ex.settle("error", "shutdown")
            resp = error_response(dialect, 503, "the proxy is shutting down", "shutdown", request_id)
            resp.force_close()
            ex.status = 503
            return resp
        return await _exchange(request, state, dialect, ex)
    except ProxyError as exc:
        ex.settle("error", exc.reason)
        ex.status = exc.status
        resp = error_response(dialect, exc.status, exc.message, exc.reason, request_id)
        if isinstance(exc, BodyTooLarge):
            resp.force_close()  # the rest of the body is unread
        return resp
    except asyncio.CancelledError:
        ex.settle("aborted", "client_disconnect")
        if ex.phase == Phase.AWAITING_HEADERS or ex.phase == Phase.RESPONDING:
            ex.cancelled(ex.interrupt or "client_disconnect")
        raise
    finally:
        state.untrack(task)
        state.recorder.finish(ex)


async def _read_body(request: web.Request, limit: int) -> bytes:
    """The client's body, bounded by --max-body-size (checked before reading when announced)."""
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"request body of {request.content_length} bytes exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _exchange(request: web.Request, state: ProxyState, dialect: Dialect, ex: Exchange) -> web.StreamResponse:
    cfg = state.config
    body = await _read_body(request, cfg.max_body_size)
    info: RequestInfo = inspect_request(dialect, body)
    ex.model, ex.stream = info.model, info.stream
    headers = request_headers(
        request.headers,
        client_ip=request.remote,
        scheme=request.scheme,
        host=request.headers.get("Host"),
        request_id=ex.request_id,
    )
    url = URL(cfg.upstream + request.raw_path, encoded=True)
    data = body if body or request.method not in _NO_BODY_METHODS else None
    ex.phase = Phase.AWAITING_HEADERS
    with upstream_request_errors(cfg.connect_timeout, cfg.first_byte_timeout):
        async with asyncio.timeout(cfg.first_byte_timeout):
            upstream = await state.upstream_session.request(
                request.method, url, data=data, headers=headers, allow_redirects=False
            )
    ex.phase = Phase.RESPONDING
    ex.upstream_status = upstream.status
    finished_cleanly = False
    try:
        content_type = upstream.headers.get("Content-Type", "")
        if 200 <= upstream.status < 300 and content_type.startswith("text/event-stream"):
            ex.stream = True
            resp = await pump_stream(request, upstream, state, dialect, ex)
        else:
            resp = await respond_whole(request, upstream, state, dialect, info, ex)
        finished_cleanly = upstream.content.is_eof()
        return resp
    finally:
        if finished_cleanly:
            upstream.release()
        else:
            upstream.close()

