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

from proxy.config import Config
from proxy.core.guard import Step, StreamGuard
from proxy.core.headers import response_headers
from proxy.core.lifecycle import Lifecycle, Reason
from proxy.core.record import ExchangeRecord
from proxy.exchange.client_io import ClientWriter
from proxy.exchange.failures import READ_ERRORS
from proxy.exchange.interrupts import Interrupted
from proxy.exchange.stream_clock import KeepaliveFailed, StreamClock, UpstreamStalled

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
    hold_until = loop.time() + cfg.hold_headers
    last_heard = loop.time()
    reader = upstream.content
    clock: StreamClock | None = None  # once committed: no timer per read (see stream_clock.py)

    async def keepalive() -> bool:
        if not guard.keepalive_safe:
            return False
        await out.write(KEEPALIVE)
        return True

    try:
        if not hold:
            await out.commit(response)
        while True:
            if clock is None and life.committed:
                clock = StreamClock(reader, idle=cfg.idle_timeout, keepalive_interval=cfg.keepalive_interval,
                                    keepalive=keepalive, last_heard=last_heard)
            try:
                if clock is not None:
                    chunk = await reader.readany()
                else:  # the hold window: a deadline for this read, the earlier of commit and stall
                    async with asyncio.timeout_at(min(hold_until, last_heard + cfg.idle_timeout)):
                        chunk = await reader.readany()
            except TimeoutError:
                if loop.time() >= last_heard + cfg.idle_timeout:
                    life.upstream_failed(Reason.STALL_TIMEOUT)
                    step = guard.fail(Reason.STALL_TIMEOUT)
                else:  # the hold window is over: commit what was held
                    step = guard.commit()
            except UpstreamStalled:
                life.upstream_failed(Reason.STALL_TIMEOUT)
                step = guard.fail(Reason.STALL_TIMEOUT)
            except KeepaliveFailed as exc:
                raise exc.cause from None  # the client's write failed: the handler's event
            except Interrupted:
                life.interrupted()
                step = guard.fail(Reason.SHUTDOWN)
            except READ_ERRORS:
                life.upstream_failed(Reason.STREAM_CUT)
                step = guard.fail(Reason.STREAM_CUT)
            else:
                last_heard = loop.time()
                if clock is not None:
                    clock.heard(last_heard)
                step = guard.feed(chunk) if chunk else guard.end_of_stream()
            whole = await send_step(out, response, step, ex, life)
            if whole is not None:
                return whole
            if step.done:
                return response
    finally:
        if clock is not None:
            clock.stop()
        count_stream(guard, ex)


def count_stream(guard: StreamGuard, ex: ExchangeRecord) -> None:
    """Copy what the guard counted into the exchange's record."""
    ex.events = guard.events
    ex.content_events = guard.content_events
    ex.rewrites = list(guard.rewrites)
    ex.record_usage(guard.usage)
    ex.upstream_message = guard.upstream_message


async def send_step(
    out: ClientWriter, response: web.StreamResponse, step: Step, ex: ExchangeRecord, life: Lifecycle
) -> web.Response | None:
    """Carry out one guard step; returns a whole response when a failure is sent as a real status."""
    if step.content_events:
        now = time.monotonic()
        if step.first_content and ex.first_content_at is None:
            ex.first_content_at = now
        ex.note_content(now, step.content_events)  # inter-token latency
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
