"""An SSE response: its status line and headers, and the handler's side of its `StreamRelay`.

The relay (proxy/exchange/stream_relay.py) does the per-event work from the upstream connection's
callbacks; the handler's coroutine wakes only for what needs awaiting: sending the status line (at
once with --hold-headers 0, else when the guard commits), the end of the body, a failure sent as a
real status, or the client's departure. What the client is told is the lifecycle's answer, carried
out by the relay (`reply.carry_out`); this side lets the client take it in (`reply.settle`).
"""

from __future__ import annotations

from proxy.config import Config
from proxy.core.guard import StreamGuard
from proxy.core.headers import response_headers
from proxy.core.lifecycle import Lifecycle
from proxy.core.record import ExchangeRecord
from proxy.exchange.client_writer import ClientGone, ClientWriter, ResponseHead
from proxy.exchange.interrupts import Interrupted, Interrupter
from proxy.exchange.reply import settle
from proxy.exchange.resume_io import Resuming, with_keepalives
from proxy.exchange.stream_relay import KEEPALIVE, Need, StreamRelay, count_stream
from proxy.exchange.upstream import UpstreamHead, UpstreamLink

__all__ = ["KEEPALIVE", "count_stream", "is_stream", "relay_stream"]


def is_stream(head: UpstreamHead) -> bool:
    """A 2xx event stream the proxy can read (one the upstream compressed anyway is copied through)."""
    encoding = head.headers.get("Content-Encoding", "identity").lower()
    return (
        200 <= head.status < 300
        and head.headers.get("Content-Type", "").startswith("text/event-stream")
        and encoding == "identity"
    )


def stream_response(head: UpstreamHead) -> ResponseHead:
    headers = response_headers(head.headers, body_rewritten=False)
    headers.popall("Content-Length", None)
    headers["Cache-Control"] = "no-cache"
    headers["X-Accel-Buffering"] = "no"
    return ResponseHead(head.status, headers, reason=head.reason or None)


async def relay_stream(
    link: UpstreamLink,
    head: UpstreamHead,
    guard: StreamGuard,
    out: ClientWriter,
    life: Lifecycle,
    ex: ExchangeRecord,
    cfg: Config,
    interrupter: Interrupter,
    resuming: Resuming | None = None,
) -> None:
    """Relay the stream until the guard or the lifecycle ends it.

    With `resuming` (--resume-on-cut), the relay's `RESUME` is carried out here, in one place: the
    continuation's connection replaces the upstream's, or the relay gives up as the stream would have
    ended without the flag.
    """
    response = stream_response(head)
    if cfg.hold_headers <= 0:
        await out.commit(response)
    relay = StreamRelay(link, guard, life, ex, cfg, out)
    interrupter.watch(relay.interrupt)
    link.attach(relay)
    try:
        while True:
            need = await relay.wait()
            if need is Need.COMMIT:
                out.commit_now(response, hold=True)  # (the relay hears a client that stops reading: no wait)
                relay.committed()  # the events the guard passed meanwhile carry the head, in one write
                out.flush_head()
            elif need is Need.DONE:  # the relay carried out the lifecycle's answer
                if relay.settle:
                    assert life.ended is not None
                    await settle(out, life.ended)
                return
            elif need is Need.RESUME:
                assert resuming is not None
                await _resume(relay, resuming, guard, cfg, interrupter)
            else:
                assert relay.bug is not None
                raise relay.bug
    finally:
        relay.stop()
        if not relay.link.complete:
            relay.link.pause_reading()  # nothing more reaches a finished relay (a drain that takes over resumes it)
        count_stream(guard, ex)


async def _resume(
    relay: StreamRelay, resuming: Resuming, guard: StreamGuard, cfg: Config, interrupter: Interrupter
) -> None:
    """The stream broke and the guard asked to continue: a continuation, or the end it would have had."""
    reason = relay.resume_reason
    assert reason is not None

    async def keepalive() -> bool:
        if not relay.keepalive():
            raise ClientGone("the client closed the connection")
        return True

    try:
        link = await with_keepalives(resuming.carry_on(guard, reason), keepalive, cfg.keepalive_interval)
    except Interrupted as exc:
        relay.give_up_for(exc.cause)
        interrupter.watch(relay.interrupt)
        return
    interrupter.watch(relay.interrupt)
    if link is None:
        relay.give_up()
    else:
        relay.relink(link)
