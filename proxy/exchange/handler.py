"""The main port's only handler: a driver that turns one exchange's I/O facts into lifecycle events.

The verdict is the lifecycle's (`proxy/core/lifecycle.py`); this module only notices what happened (a
refusal, an upstream failure, a client write that failed, shutdown or the client's departure, both
`Interrupted` inside the wait they come in, the departure fired by its connection) and carries out the answer: a whole
error response, the stream's error frame, a cut connection, a drain. The upstream response lives
in the handler's one `try/finally`, which closes it unless it was read to its end, so a failure or a
departed client never leaves a half-read connection in the pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass

from multidict import CIMultiDict

from proxy.config import Config
from proxy.core.dialects import Dialect, RequestInfo, for_request, read_request
from proxy.core.guard import Failure, StreamGuard
from proxy.core.lifecycle import Answer, Lifecycle, Reason, Reply
from proxy.core.record import ExchangeRecord
from proxy.core.resume import RESUMABLE_APIS, Resumer
from proxy.exchange.client import ClientRequest
from proxy.exchange.client_writer import ClientStalled, ClientWriter
from proxy.exchange.deadline import Deadline
from proxy.exchange.drain import drain
from proxy.exchange.errors import Cause, Interrupted, Interrupter, Refusal, UpstreamFailure, first_byte_timeout, told
from proxy.exchange.reply import carry_out, settle, settle_now
from proxy.exchange.request_io import INFLATE_LIMIT, PARSE_LIMIT, read_body, upstream_headers, upstream_target
from proxy.exchange.resume_io import Resuming, continuation_headers, count_tokens, open_continuation
from proxy.exchange.state import ProxyState
from proxy.exchange.stream import is_stream, relay_stream
from proxy.exchange.upstream import BodyReader, UpstreamHead, UpstreamLink
from proxy.exchange.whole import respond_whole
from proxy.observe.request_ids import new_request_id

__all__ = ["client_request_id", "handle"]

_REQUEST_ID = "X-Request-Id"
_CAUSE_MAX = 200
_NO_BODY_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE", "TRACE"})
_REQUEST_ID_MAX = 200
_SHUTTING_DOWN = "the proxy is shutting down"


def client_request_id(value: str | None) -> bool:
    """A client's X-Request-Id is used only when it is 1-200 printable ASCII characters."""
    return value is not None and 0 < len(value) <= _REQUEST_ID_MAX and value.isascii() and value.isprintable()


@dataclass(slots=True)
class _Flight:
    """What one exchange holds while it runs: its upstream request and answer, its stream guard."""

    ex: ExchangeRecord
    life: Lifecycle
    dialect: Dialect
    out: ClientWriter
    interrupter: Interrupter
    info: RequestInfo | None = None
    sending: asyncio.Future[tuple[UpstreamLink, UpstreamHead]] | None = None
    link: UpstreamLink | None = None
    head: UpstreamHead | None = None
    reader: BodyReader | None = None  # a whole body's
    guard: StreamGuard | None = None
    handed_over: bool = False  # a drain task owns the upstream and the books from here on


async def handle(request: ClientRequest, state: ProxyState) -> None:
    cfg = state.config
    dialect = for_request(request.method, request.path)
    sent_id = request.headers.get(_REQUEST_ID)
    request_id = sent_id if sent_id is not None and client_request_id(sent_id) else new_request_id()
    ex = ExchangeRecord(request_id, request.method, request.path, dialect.name, request.remote)
    if sent_id is not None and sent_id != request_id:
        ex.client_request_id = sent_id  # logged escaped and cut; never echoed or sent upstream
    life = Lifecycle(ex, drain_on_abandon=cfg.on_abandon == "drain")
    flight = _Flight(ex, life, dialect, ClientWriter(request, ex, life, cfg.client_stall_timeout), Interrupter())
    state.books.start(ex, request.headers)
    state.track(flight.interrupter, ex)
    request.on_departure(lambda: flight.interrupter.fire(Cause.CLIENT_GONE))
    try:
        try:
            if state.draining:
                raise Refusal(Reason.SHUTDOWN, _SHUTTING_DOWN)
            return await _exchange(request, state, flight)
        except Refusal as refusal:
            ex.cause = refusal.message[:_CAUSE_MAX]
            return await _tell(flight, life.refused(refusal.reason), refusal.message, refusal.headers)
        except UpstreamFailure as failure:
            ex.cause = failure.message[:_CAUSE_MAX]  # the client got it; the log line says it too
            return await _tell(flight, life.upstream_failed(failure.reason), failure.message)
        except Interrupted as interruption:  # shutdown, or the client's departure, inside the wait it was in
            return await _tell(flight, told(life, interruption.cause), _SHUTTING_DOWN)
    except ClientStalled:
        return await _tell(flight, life.client_stalled(), "")
    except ConnectionError:  # a write found the client's socket closed before its close was noticed
        return await _tell(flight, life.client_gone(), "")
    except asyncio.CancelledError:  # shutdown's final cleanup cut this one
        life.interrupted()
        raise
    except Exception:
        answer = life.bug()
        state.books.logger.exception("proxy_error", request_id=ex.request_id)
        try:
            return await _tell_bug(flight, answer)
        except (ClientStalled, ConnectionError):
            return flight.out.cut()
    finally:
        state.body_budget.give_back(ex.body_reserved)
        ex.body_reserved = 0
        flight.out.release_flow()
        ended = life.ended
        if ended is not None and ended.drain:  # --on-abandon drain: the upstream is read on, not cancelled
            _hand_over_to_drain(state, flight)
        if not flight.handed_over:  # (else the drain task does this when it is done)
            _release_upstream(state, flight)
            state.untrack(flight.interrupter)
            state.books.finish(ex)
            state.cancel_hooks.fire(ex, request.headers)  # --cancel-hook: after a cancelled upstream
            flight.interrupter.forget()  # no cycle outlives the exchange: refcounting frees it, not the GC
        request.on_departure(None)


async def _exchange(request: ClientRequest, state: ProxyState, flight: _Flight) -> None:
    cfg, ex, life, dialect = state.config, flight.ex, flight.life, flight.dialect
    target = upstream_target(request)
    content = request.content
    flight.interrupter.watch(lambda cause: content.set_exception(Interrupted(cause)))
    body = await read_body(request, cfg, state.body_budget, ex)
    info, resumer = _read_request(cfg, dialect, body, request.headers.get("Content-Encoding"))
    flight.info = info
    ex.model, ex.stream = info.model, info.stream
    headers = upstream_headers(request, state, dialect, ex)
    data = body if body or request.method not in _NO_BODY_METHODS else None
    life.sent()
    try:
        with Deadline(state.loop, cfg.first_byte_timeout) as deadline:
            flight.interrupter.watch_deadline(deadline)
            sending = state.upstream.request(request.method, target, headers, data)
            if life.drain_on_abandon:  # the request must outlive this handler if its client leaves
                flight.sending = asyncio.ensure_future(sending)
                link, head = await asyncio.shield(flight.sending)
            else:
                link, head = await sending
            flight.link, flight.head = link, head
    except TimeoutError as exc:
        if flight.interrupter.fired:
            raise flight.interrupter.error() from exc
        raise first_byte_timeout(cfg.first_byte_timeout) from None
    # The body has gone upstream: its bytes no longer count against the shared bound (unless
    # --resume-on-cut keeps them for a continuation: then they count until the exchange ends).
    if resumer is None or not resumer.possible:
        state.body_budget.give_back(ex.body_reserved)
        ex.body_reserved = 0
    # What only the request needed is not kept while a stream runs (its headers are, for a
    # continuation, which resends them).
    del body, data, sending, deadline
    if resumer is None:
        del headers
    ex.upstream_status = head.status
    if not 200 <= head.status <= 599:  # an unrequested 101 (Upgrade is hop-by-hop, never sent), or junk
        message = f"the upstream answered with status {head.status}, which is not passed on"
        raise UpstreamFailure(Reason.BAD_UPSTREAM_RESPONSE, message)
    stream = is_stream(head)
    life.headers_received(stream=stream)
    if stream:
        ex.stream = True
        may_resume = resumer.may_resume if resumer is not None else None
        flight.guard = StreamGuard(
            dialect, hold=cfg.hold_headers > 0, max_event_size=cfg.max_event_size, may_resume=may_resume
        )
        resuming = None
        if resumer is not None:
            if resumer.possible:  # (else every break is refused: no transcript to keep)
                resumer.watch(flight.guard.stream)
            ex.resumer = resumer
            resuming = _resuming(state, flight, resumer, target, headers)
        return await relay_stream(
            link, head, flight.guard, flight.out, life, ex, cfg, flight.interrupter, resuming
        )
    reader = flight.reader = BodyReader(link)
    answer = await respond_whole(
        reader, head, flight.out, life, ex, dialect, info, flight.interrupter,
        max_body_size=cfg.max_body_size, idle_timeout=cfg.idle_timeout,
    )
    return await _tell(flight, answer, "")


def _read_request(
    cfg: Config, dialect: Dialect, body: bytes | bytearray, encoding: str | None
) -> tuple[RequestInfo, Resumer | None]:
    """The body's facts and, with --resume-on-cut, a streamed chat or completions request's decisions
    (None: not one), from one parse at most; the parsed object is not kept."""
    inflate = min(cfg.max_body_size, INFLATE_LIMIT)
    info, parsed = read_request(dialect, body, encoding, inflate, parse_limit=PARSE_LIMIT)
    if not cfg.resume_on_cut or not info.stream or dialect.name not in RESUMABLE_APIS:
        return info, None
    # (not parsed: a compressed body, the continuation being plain JSON, or one too costly to parse)
    return info, Resumer(dialect.name, body, cfg.resume_on_cut, cfg.max_body_size, request=parsed)


def _resuming(state: ProxyState, flight: _Flight, resumer: Resumer, target: str, headers: CIMultiDict[str]) -> Resuming:
    """How this exchange sends a continuation: the same upstream, the client's headers, a plain JSON body."""
    cfg, pool = state.config, state.upstream
    sent = continuation_headers(headers)

    def drop_broken() -> None:
        if flight.link is not None:  # the broken response: its connection is never reused
            pool.close_link(flight.link)
            flight.link = None

    async def reopen(body: bytes) -> UpstreamLink:
        drop_broken()
        link, head = await open_continuation(
            pool, target, sent, body, first_byte_timeout=cfg.first_byte_timeout, interrupter=flight.interrupter
        )
        flight.link, flight.head = link, head
        return link

    async def tokenize(body: bytes, limit: int) -> tuple[int, bytes]:
        drop_broken()  # (the backend stops generating for it meanwhile)
        return await count_tokens(
            pool, sent, body, limit, within=cfg.first_byte_timeout, interrupter=flight.interrupter
        )

    return Resuming(resumer, reopen, tokenize, flight.interrupter, cfg.first_byte_timeout)


async def _tell(
    flight: _Flight, answer: Answer | None, message: str, headers: dict[str, str] | None = None,
    failure: Failure | None = None,
) -> None:
    """Carry out an ending's answer (`proxy.exchange.reply`) and let the client take it in; a STATUS
    is worded by `message` or, when the guard worded it, by its `failure`."""
    out = flight.out
    frame = b""
    if answer is not None and answer.reply is Reply.FRAME and flight.guard is not None:
        frame = flight.guard.fail(answer.reason).data
    try:
        go_on = carry_out(
            out, answer, dialect=flight.dialect, message=message, headers=headers, frame=frame, failure=failure
        )
    except ConnectionError:  # the verdict stands; the client simply did not take it
        out.cut()
        return
    if go_on:
        assert answer is not None
        if not settle_now(out, answer):
            await settle(out, answer)


async def _tell_bug(flight: _Flight, answer: Answer | None) -> None:
    """A bug of ours: a 500 in the dialect's shape, an error frame in a stream, else a cut; never a traceback."""
    guard, failure = flight.guard, None
    if guard is not None and answer is not None and answer.reply is Reply.STATUS:
        try:
            failure = guard.fail(Reason.PROXY_ERROR).failure  # the dialect's own error, as the guard words it
        except Exception:  # the guard itself is what broke
            flight.out.cut()
            return
    try:
        await _tell(flight, answer, "the proxy failed to handle the request", failure=failure)
    except Exception:  # the guard itself is what broke
        flight.out.cut()


def _release_upstream(state: ProxyState, flight: _Flight) -> None:
    """Back to the pool only when read to its end and not cancelled; otherwise the connection closes."""
    if flight.sending is not None and not flight.sending.done():
        flight.sending.cancel()  # the client left (or a timeout came) before the upstream answered
    link = flight.link
    if link is None:
        return
    ended = flight.life.ended
    if ended is not None and ended.cancel is None and link.complete:
        state.upstream.release(link)
    else:
        state.upstream.close_link(link)


def _hand_over_to_drain(state: ProxyState, flight: _Flight) -> None:
    """--on-abandon drain: a task reads the upstream's answer on for its usage, then writes the books."""
    cfg, ex = state.config, flight.ex
    answer: Awaitable[tuple[UpstreamLink, UpstreamHead]]
    if flight.link is not None and flight.head is not None:
        answer = _ready(flight.link, flight.head)
    elif flight.sending is not None:
        answer = flight.sending
    else:
        return
    assert flight.info is not None
    pool = state.upstream

    def finish() -> None:
        state.untrack(flight.interrupter)
        state.books.finish(ex)

    flight.handed_over = True
    state.background.spawn(drain(
        answer, pool, ex, flight.dialect, flight.info, guard=flight.guard, reader=flight.reader,
        first_byte_timeout=cfg.first_byte_timeout, idle_timeout=cfg.idle_timeout,
        max_body_size=cfg.max_body_size, max_event_size=cfg.max_event_size, finish=finish,
    ))


async def _ready(link: UpstreamLink, head: UpstreamHead) -> tuple[UpstreamLink, UpstreamHead]:
    return link, head
