"""The I/O loop around `StreamGuard` for an SSE response: read upstream, write what the guard says.

All deciding lives in the sans-IO guard and the exchange's lifecycle; this loop owns the clocks
(hold window, keep-alive, idle timeout) and turns what the upstream's socket does (bytes, EOF, a
cut, silence, shutdown's `Interrupted`) into guard inputs and lifecycle events. A failing write to
the client is raised to the handler, which turns it into the lifecycle's client event. Once the
status line is out nothing here lets aiohttp write a second response into the body: a failure ends
in the guard's error frame.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from .books import ExchangeRecord
from .client_io import ClientWriter
from .config import Config
from .failures import READ_ERRORS
from .guard import Step, StreamGuard
from .headers import response_headers
from .interrupts import Interrupted
from .lifecycle import Lifecycle, Reason

__all__ = ["KEEPALIVE", "count_stream", "is_stream", "pump_stream", "send_step"]

KEEPALIVE = b": keep-alive\n\n"


def is_stream(upstream: aiohttp.ClientResponse) -> bool:
    """A 2xx event stream the proxy can read (one the upstream compressed anyway is copied through)."""
    encoding = upstream.headers.get("Content-Encoding", "identity").lower()
    return (
        200 <= upstream.status < 300
        and upstream.headers.get("Content-Type", "").startswith("text/event-stream")
        and encoding == "identity"
    )


def stream_response(upstream: aiohttp.ClientResponse, request_id: str) -> web.StreamResponse:
    headers = response_headers(upstream.headers, body_rewritten=False)
    headers.popall("Content-Length", None)
    headers["Cache-Control"] = "no-cache"
    headers["X-Accel-Buffering"] = "no"
    headers["X-Request-Id"] = request_id
    return web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)


async def pump_stream(
    upstream: aiohttp.ClientResponse,
    guard: StreamGuard,
    out: ClientWriter,
    life: Lifecycle,
    ex: ExchangeRecord,
    cfg: Config,
) -> web.StreamResponse:
    """Forward the stream until the guard or the lifecycle ends it; returns the response to give aiohttp."""
    response = stream_response(upstream, ex.request_id)
    hold = cfg.hold_headers > 0
    loop = asyncio.get_running_loop()
    hold_until = loop.time() + cfg.hold_headers if hold else None
    last_heard = last_sent = loop.time()
    reader = upstream.content
    try:
        if not hold:
            await out.commit(response)
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
                    life.upstream_failed(Reason.STALL_TIMEOUT)
                    step = guard.fail(Reason.STALL_TIMEOUT)
                else:
                    if guard.keepalive_safe:
                        await out.write(KEEPALIVE)
                    last_sent = now
                    continue
            except Interrupted:
                life.interrupted()
                step = guard.fail(Reason.SHUTDOWN)
            except READ_ERRORS:
                life.upstream_failed(Reason.STREAM_CUT)
                step = guard.fail(Reason.STREAM_CUT)
            else:
                last_heard = loop.time()
                step = guard.feed(chunk) if chunk else guard.end_of_stream()
                if guard.committed:
                    hold_until = None
            whole = await send_step(out, response, step, ex, life)
            if whole is not None:
                return whole
            if step.done:
                return response
    finally:
        count_stream(guard, ex)


def count_stream(guard: StreamGuard, ex: ExchangeRecord) -> None:
    """Copy what the guard counted into the exchange's record."""
    ex.events = guard.events
    ex.content_events = guard.content_events
    ex.rewrites = list(guard.rewrites)
    ex.record_usage(guard.usage)


async def send_step(
    out: ClientWriter, response: web.StreamResponse, step: Step, ex: ExchangeRecord, life: Lifecycle
) -> web.Response | None:
    """Carry out one guard step; returns a whole response when a failure is sent as a real status."""
    if step.first_content and ex.first_content_at is None:
        ex.first_content_at = time.monotonic()
    if step.content_events:  # inter-token latency
        ex.note_content(time.monotonic(), step.content_events)
    if step.done:
        life.guard_ended(step.outcome or "error", step.reason or Reason.PROXY_ERROR)
    failure = step.failure
    if failure is not None and not life.committed:
        return out.whole(failure.status, failure.body, {"X-Request-Id": ex.request_id, **failure.headers})
    if step.commit:
        await out.commit(response)
    if step.data:
        if not life.committed:
            await out.commit(response)
        await out.write(step.data)
    return None
