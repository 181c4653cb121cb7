"""The I/O loop around `StreamGuard` for an SSE response: read upstream, write what the guard says.

All deciding lives in the sans-IO guard; this loop only owns the clocks (hold window, keep-alive,
idle timeout), the client's write side and the cancellation paths. Once the client's status line
is out, nothing here may raise into aiohttp: aiohttp would write a second HTTP response into the
body, the very bug this proxy exists to hide. So every late failure ends in an error frame or an
aborted client connection.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from .abandon import absorb_cancellation, drain_stream, start_drain
from .client_io import ClientStalled, ClientWriter
from .dialects import Dialect
from .exchange import Exchange
from .guard import Step, StreamGuard
from .headers import response_headers
from .state import ProxyState

__all__ = ["KEEPALIVE", "count_stream", "is_stream", "pump_stream"]

KEEPALIVE = b": keep-alive\n\n"
_READ_ERRORS = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, OSError)


def is_stream(upstream: aiohttp.ClientResponse) -> bool:
    """A 2xx event stream the proxy can read (one the upstream compressed anyway is copied through)."""
    encoding = upstream.headers.get("Content-Encoding", "identity").lower()
    return (
        200 <= upstream.status < 300
        and upstream.headers.get("Content-Type", "").startswith("text/event-stream")
        and encoding == "identity"
    )


def _stream_response(upstream: aiohttp.ClientResponse, request_id: str) -> web.StreamResponse:
    headers = response_headers(upstream.headers, body_rewritten=False)
    headers.popall("Content-Length", None)
    headers["Cache-Control"] = "no-cache"
    headers["X-Accel-Buffering"] = "no"
    headers["X-Request-Id"] = request_id
    return web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)


async def pump_stream(
    request: web.BaseRequest, upstream: aiohttp.ClientResponse, state: ProxyState, dialect: Dialect, ex: Exchange
) -> web.StreamResponse:
    cfg = state.config
    hold = cfg.hold_headers > 0
    guard = StreamGuard(dialect, hold=hold, max_event_size=cfg.max_event_size)
    out = ClientWriter(request, _stream_response(upstream, ex.request_id), ex, cfg.client_stall_timeout)
    loop = asyncio.get_running_loop()
    hold_until = loop.time() + cfg.hold_headers if hold else None
    last_heard = last_sent = loop.time()
    reader = upstream.content
    try:
        if not hold:
            await out.commit()
        while True:
            deadline = last_heard + cfg.idle_timeout
            if hold_until is not None:
                deadline = min(deadline, hold_until)
            elif cfg.keepalive_interval:
                deadline = min(deadline, max(last_heard, last_sent) + cfg.keepalive_interval)
            try:
                async with asyncio.timeout_at(deadline):
                    chunk = await reader.readany()
            except TimeoutError:
                now = loop.time()
                if hold_until is not None and now >= hold_until:
                    hold_until = None
                    step = guard.commit()
                elif now >= last_heard + cfg.idle_timeout:
                    ex.cancelled("stall_timeout")
                    step = guard.fail("stall_timeout")
                else:
                    if guard.keepalive_safe:
                        await out.write(KEEPALIVE)
                    last_sent = now
                    continue
            except _READ_ERRORS:
                step = guard.fail("stream_cut")
            else:
                last_heard = loop.time()
                step = guard.feed(chunk) if chunk else guard.end_of_stream()
                if guard.committed:
                    hold_until = None
            response = await _apply(out, step, ex)
            if response is not None:
                return response
            if step.done:
                break
    except ClientStalled:
        ex.settle("aborted", "client_stalled")
        ex.cancelled("client_stalled")
        out.abort()
    except ConnectionError:
        # A write found the client's socket closed before aiohttp noticed the close itself.
        ex.settle("aborted", "client_disconnect")
        ex.cancelled("client_disconnect")
        out.abort()
    except asyncio.CancelledError:
        if start_drain(ex, cfg.on_abandon):
            await drain_stream(reader, guard, cfg.idle_timeout)
            raise
        if ex.interrupt is None or not absorb_cancellation():
            raise  # the client left (or more than one cancellation is pending): just unwind
        # The server asked this stream to end (shutdown): finish it with the dialect's error frame.
        ex.cancelled(ex.interrupt)
        response = await _finish_quietly(out, guard.fail(ex.interrupt), ex)
        if response is not None:
            return response
    except Exception:
        # A bug of ours: end as cleanly as the guard still allows (a 500 or an error frame), else cut.
        ex.settle("error", "proxy_error")
        state.recorder.logger.exception("proxy_error", request_id=ex.request_id)
        response = await _end_after_bug(out, guard, ex)
        if response is not None:
            return response
    finally:
        count_stream(guard, ex)
    return out.response


def count_stream(guard: StreamGuard, ex: Exchange) -> None:
    """Copy what the guard counted into the exchange's record."""
    ex.events = guard.events
    ex.content_events = guard.content_events
    ex.rewrites = list(guard.rewrites)
    ex.record_usage(guard.usage)


async def _apply(out: ClientWriter, step: Step, ex: Exchange) -> web.Response | None:
    """Carry out one guard step; returns a whole response when a failure is sent as a real status."""
    if step.first_content and ex.first_content_at is None:
        ex.first_content_at = time.monotonic()
    if step.content_events:  # issue 13: inter-token latency
        ex.note_content(time.monotonic(), step.content_events)
    if step.done:
        ex.settle(step.outcome or "error", step.reason or "proxy_error")
        if step.outcome == "error":
            ex.cancelled("upstream_error")
    if step.failure is not None and not out.committed:
        failure = step.failure
        ex.status, ex.bytes_out = failure.status, len(failure.body)
        headers = {"X-Request-Id": ex.request_id, **failure.headers}
        return web.Response(
            status=failure.status, body=failure.body, content_type="application/json", headers=headers
        )
    if step.commit:
        await out.commit()
    if step.data:
        await out.write(step.data)
    return None


async def _finish_quietly(out: ClientWriter, step: Step, ex: Exchange) -> web.Response | None:
    try:
        return await _apply(out, step, ex)
    except (ClientStalled, ConnectionError):
        out.abort()
        return None


async def _end_after_bug(out: ClientWriter, guard: StreamGuard, ex: Exchange) -> web.Response | None:
    """A 500 before the commit, an error frame after it; a cut if the guard has nothing to say."""
    try:
        step = guard.fail("proxy_error")
        if step.failure is not None or step.data:
            return await _finish_quietly(out, step, ex)
    except Exception:  # the guard itself is what broke
        pass
    out.abort()
    return None
