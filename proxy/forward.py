"""The main port's only handler: one exchange from the client's request to its recorded outcome.

Phases (design section 2): received -> awaiting headers -> responding -> finished. The upstream
response lives in one `try/finally` that closes it unless it was read to its end, so a client that
leaves (aiohttp cancels this handler: the server runs with `handler_cancellation=True`) or any
failure closes the upstream connection at once instead of returning it to the pool half-read.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web
from yarl import URL

from .abandon import absorb_cancellation, drain_stream, drain_whole, start_drain
from .body_io import respond_whole
from .config import Config
from .connections import ClientConnection
from .dialects import Dialect, RequestInfo, for_request, inspect_request
from .errors import (
    BadRequest,
    BadUpstreamResponse,
    BodyTooLarge,
    ClientTimeout,
    FirstByteTimeout,
    ProxyError,
    ProxyOverloaded,
    upstream_request_errors,
)
from .exchange import Exchange, Phase
from .guard import StreamGuard
from .headers import request_headers
from .state import ProxyState
from .stream_io import count_stream, is_stream, pump_stream
from .target import BadTarget, forwarded_target

__all__ = ["client_request_id", "error_response", "make_handler"]

_REQUEST_ID = "X-Request-Id"
_NO_BODY_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE", "TRACE"})
_REQUEST_ID_MAX = 200
# A compressed body is inflated (a copy, for its model and stream flags) up to this size: inflating
# blocks the event loop, and a small gzip can hold gigabytes. A larger one is forwarded unnoted.
INFLATE_LIMIT = 8 * 1024 * 1024


def error_response(
    dialect: Dialect, status: int, message: str, code: str, ex: Exchange, headers: dict[str, str] | None = None
) -> web.Response:
    """A whole JSON error in the client's dialect (used before anything was sent)."""
    body = dialect.error_body(status, message, code)
    ex.status, ex.bytes_out = status, len(body)
    return web.Response(
        status=status,
        body=body,
        content_type="application/json",
        headers={_REQUEST_ID: ex.request_id, **(headers or {})},
    )


def client_request_id(value: str | None) -> bool:
    """A client's X-Request-Id is used only when it is 1-200 printable ASCII characters."""
    return value is not None and 0 < len(value) <= _REQUEST_ID_MAX and value.isascii() and value.isprintable()


def make_handler(state: ProxyState) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
    """The main port's one handler (every method and path), bound to the proxy's state."""

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        try:
            return await handle(request, state)
        finally:
            # The next bytes are a new request's head only once this body was read to its end (an
            # unread one is refused with Connection: close, and aiohttp discards the rest of it).
            if isinstance(request.protocol, ClientConnection) and request.content.is_eof():
                request.protocol.request_done()

    return handler


async def handle(request: web.BaseRequest, state: ProxyState) -> web.StreamResponse:
    dialect = for_request(request.method, request.path)
    sent_id = request.headers.get(_REQUEST_ID)
    request_id = sent_id if sent_id is not None and client_request_id(sent_id) else uuid.uuid4().hex
    ex = Exchange(request_id, request.method, request.path, dialect.name, request.remote)
    if sent_id is not None and sent_id != request_id:
        ex.client_request_id = sent_id  # logged escaped and cut; never echoed or sent upstream
    task = asyncio.current_task()
    assert task is not None
    state.recorder.start(ex, request.headers)
    state.track(task, ex)
    try:
        if state.draining:
            ex.settle("error", "shutdown")
            resp = error_response(dialect, 503, "the proxy is shutting down", "shutdown", ex)
            resp.force_close()
            return resp
        return await _exchange(request, state, dialect, ex)
    except ProxyError as exc:
        ex.settle("error", exc.reason)
        if isinstance(exc, FirstByteTimeout):
            ex.cancelled("first_byte_timeout")
        resp = error_response(dialect, exc.status, exc.message, exc.reason, ex, exc.headers)
        if exc.close:
            resp.force_close()  # the rest of the body is unread
        return resp
    except asyncio.CancelledError:
        if ex.interrupt is not None and not ex.committed and absorb_cancellation():
            # Shutdown reached an exchange that has sent nothing yet: a real 503 it can retry.
            ex.settle("error", ex.interrupt)
            ex.cancelled(ex.interrupt)
            resp = error_response(dialect, 503, "the proxy is shutting down", ex.interrupt, ex)
            resp.force_close()
            return resp
        ex.settle("aborted", "client_disconnect")
        if ex.phase in (Phase.AWAITING_HEADERS, Phase.RESPONDING) and not ex.drained:
            ex.cancelled(ex.interrupt or "client_disconnect")
        raise
    except Exception:
        # A bug of ours. Before the status line: a 500 in the dialect's shape, never a traceback.
        # After it: cut the connection rather than let aiohttp write a second response into the body.
        ex.settle("error", "proxy_error")
        state.recorder.logger.exception("proxy_error", request_id=ex.request_id)
        if ex.committed:
            transport = request.transport
            if transport is not None:
                transport.abort()
            raise
        return error_response(dialect, 500, "the proxy failed to handle the request", "proxy_error", ex)
    finally:
        state.body_budget.give_back(ex.body_reserved)
        ex.body_reserved = 0
        state.untrack(task)
        state.recorder.finish(ex)
        state.cancel_hooks.fire(ex, request.headers, state.session)  # --cancel-hook: after a cancelled upstream


async def _read_body(request: web.BaseRequest, state: ProxyState, ex: Exchange) -> bytes:
    """The client's body as it came on the wire (a compressed one too).

    Bounded by --max-body-size (checked before reading when announced), by --client-body-timeout
    between reads, and by the bytes all exchanges may hold at once (--max-buffered-body-bytes).
    """
    cfg, budget = state.config, state.body_budget
    limit, announced = cfg.max_body_size, request.content_length
    if announced is not None and announced > limit:
        raise BodyTooLarge(f"request body of {announced} bytes exceeds the limit of {limit} bytes")
    if announced and not await budget.take(announced):
        raise ProxyOverloaded()
    ex.body_reserved = announced or 0
    if request.headers.get("Expect", "").lower() == "100-continue" and request.version >= (1, 1):
        # The proxy answers it (the upstream is sent the whole body): now, as the body is wanted.
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0
    chunks: list[bytes] = []
    size = 0
    while True:
        try:
            async with asyncio.timeout(cfg.client_body_timeout):
                chunk = await request.content.readany()
        except TimeoutError:
            raise ClientTimeout(f"the request body stopped arriving for {cfg.client_body_timeout:g} s") from None
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
        if announced is None:  # chunked: reserve as it comes
            if not await budget.take(len(chunk)):
                raise ProxyOverloaded()
            ex.body_reserved += len(chunk)
        chunks.append(chunk)


def _check_upstream_status(upstream: aiohttp.ClientResponse) -> None:
    """A status the client can be given: 1xx are never final here (Upgrade is hop-by-hop, never sent)."""
    if not 200 <= upstream.status <= 599:
        upstream.close()
        raise BadUpstreamResponse(f"the upstream answered with status {upstream.status}, which is not passed on")


async def _exchange(
    request: web.BaseRequest, state: ProxyState, dialect: Dialect, ex: Exchange
) -> web.StreamResponse:
    cfg = state.config
    try:
        target = forwarded_target(request.raw_path)
    except BadTarget as exc:
        raise BadRequest(str(exc)) from None
    body = await _read_body(request, state, ex)
    info: RequestInfo = inspect_request(
        dialect, body, request.headers.get("Content-Encoding"), min(cfg.max_body_size, INFLATE_LIMIT)
    )
    ex.model, ex.stream = info.model, info.stream
    headers = request_headers(
        request.headers,
        client_ip=request.remote,
        scheme=request.scheme,
        host=request.headers.get("Host"),
        request_id=ex.request_id,
    )
    if dialect.json_body:
        # The guard must read what the upstream sends: ask for it uncompressed. The hop is the pod's
        # loopback, where compression saves nothing (and vLLM and llama.cpp do not compress anyway).
        headers.popall("Accept-Encoding", None)
    if state.upstream_authorization and "Authorization" not in headers:
        headers["Authorization"] = state.upstream_authorization
    state.recorder.propagate(ex, headers)  # issue 13: the proxy's span context goes upstream
    url = URL(state.upstream_base + target, encoded=True)
    data = body if body or request.method not in _NO_BODY_METHODS else None
    ex.phase = Phase.AWAITING_HEADERS
    with upstream_request_errors(cfg.connect_timeout, cfg.first_byte_timeout):
        async with asyncio.timeout(cfg.first_byte_timeout):
            sending = state.upstream_session.request(
                request.method, url, data=data, headers=headers, allow_redirects=False
            )
            if cfg.on_abandon == "drain":
                upstream = await _outlasting_the_client(asyncio.ensure_future(sending), dialect, info, ex, cfg)
            else:
                upstream = await sending
    # The body has gone upstream: its bytes no longer count against the shared bound.
    state.body_budget.give_back(ex.body_reserved)
    ex.body_reserved = 0
    del body, data
    ex.upstream_status = upstream.status
    _check_upstream_status(upstream)
    ex.phase = Phase.RESPONDING
    stream = is_stream(upstream)
    finished_cleanly = False
    try:
        if stream:
            ex.stream = True
            resp = await pump_stream(request, upstream, state, dialect, ex)
        else:
            resp = await respond_whole(request, upstream, state, dialect, info, ex)
        finished_cleanly = upstream.content.is_eof()
        return resp
    except asyncio.CancelledError:
        if not stream and start_drain(ex, cfg.on_abandon):  # (pump_stream drains a stream itself)
            await drain_whole(upstream, dialect, info, ex, cfg.max_body_size, cfg.idle_timeout)
        raise
    finally:
        if finished_cleanly:
            upstream.release()
        else:
            upstream.close()


async def _outlasting_the_client(
    sending: asyncio.Future[aiohttp.ClientResponse], dialect: Dialect, info: RequestInfo, ex: Exchange, cfg: Config
) -> aiohttp.ClientResponse:
    """--on-abandon drain: if the client leaves while the upstream works, let the upstream finish.

    The request runs as its own future so the client's departure (which cancels this handler) does
    not cancel it; its answer is then read only for its usage, and the client's cancellation goes on.
    """
    try:
        return await asyncio.shield(sending)
    except asyncio.CancelledError:
        if not start_drain(ex, cfg.on_abandon):
            sending.cancel()
            raise
        try:
            upstream = await sending  # still under --first-byte-timeout
        except (aiohttp.ClientError, OSError):
            raise asyncio.CancelledError from None
        try:
            if is_stream(upstream):
                guard = StreamGuard(dialect, hold=False, max_event_size=cfg.max_event_size)
                await drain_stream(upstream.content, guard, cfg.idle_timeout)
                count_stream(guard, ex)
            else:
                await drain_whole(upstream, dialect, info, ex, cfg.max_body_size, cfg.idle_timeout)
        finally:
            upstream.close()
        raise asyncio.CancelledError from None
