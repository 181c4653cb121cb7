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
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar, cast

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
# A whole body up to this size, all here with its head, is answered in the upstream's callback: a
# client whose socket buffer is empty takes it without pausing the writes (uvloop's high water: 64 KiB).
_AT_ONCE_BYTES = 32 * 1024
_T = TypeVar("_T")


def client_request_id(value: str | None) -> bool:
    """A client's X-Request-Id is used only when it is 1-200 printable ASCII characters."""
    return value is not None and 0 < len(value) <= _REQUEST_ID_MAX and value.isascii() and value.isprintable()


class _Flight:
    """One exchange, what it holds while it runs (its request, records, upstream request and answer,
    stream guard), and, while it is carried in callbacks, the upstream head's receiver."""

    __slots__ = ("dialect", "ex", "guard", "handed_over", "head", "headers", "info", "interrupter", "life", "link",
                 "out", "reader", "request", "resumer", "sending", "state", "target")  # fmt: skip

    def __init__(self, request: ClientRequest, state: ProxyState, ex: ExchangeRecord, life: Lifecycle,
                 dialect: Dialect) -> None:  # fmt: skip
        self.request = request
        self.state = state
        self.ex = ex
        self.life = life
        self.dialect = dialect
        self.out = ClientWriter(request, ex, life, state.config.client_stall_timeout)
        self.interrupter = Interrupter()
        self.info: RequestInfo | None = None
        self.sending: asyncio.Future[tuple[UpstreamLink, UpstreamHead]] | None = None
        self.link: UpstreamLink | None = None
        self.head: UpstreamHead | None = None
        self.reader: BodyReader | None = None  # a whole body's
        self.guard: StreamGuard | None = None
        self.handed_over = False  # a drain task owns the upstream and the books from here on
        # What a stream's continuation needs (--resume-on-cut), kept from the request's steps.
        self.target = ""
        self.headers: CIMultiDict[str] | None = None
        self.resumer: Resumer | None = None

    # ---- HeadReceiver: the upstream's head, while the exchange is carried in callbacks --------------

    def on_head(self, head: UpstreamHead) -> None:
        self._waited()
        try:
            link = self.link
            assert link is not None
            if _headed(self, head):
                self.hand_over(_streamed(self))
                return
            reader = self.reader = BodyReader(link)  # (what came with the head is delivered at once)
            if not _whole_at_once(self, reader):
                self.hand_over(_whole(self))  # more body to wait for, or a client to wait on: a task
                return
            answer = _at_once(_respond(self))
            if not _tell_now(self, answer, ""):
                assert answer is not None
                self.hand_over(settle(self.out, answer))
                return
        except Exception as exc:
            if not _answer_now(self, exc):
                self.hand_over(_settle_ended(self))
                return
        self.end()

    def on_failure(self, failure: UpstreamFailure) -> None:
        self._waited()
        self._ended_by(failure)

    def _interrupted(self, cause: Cause) -> None:
        self._waited()
        self._ended_by(Interrupted(cause))

    def _waited(self) -> None:
        """The wait for the head is over: its interrupter's watch goes."""
        self.interrupter.forget()

    def _ended_by(self, error: Exception) -> None:
        if self.life.ended is not None:
            return  # (ended already: the first ending stands)
        if not _answer_now(self, error):
            self.hand_over(_settle_ended(self))
            return
        self.end()

    def hand_over(self, work: Coroutine[Any, Any, None]) -> None:
        """The rest waits for real (a stream, a body still arriving, a client to drain): a task runs it,
        with the same endings, and the books at its end."""
        self.request.task = self.state.loop.create_task(_then(self, work, finish=True))

    def end(self) -> None:
        try:
            _finish(self)
        finally:
            self.request.finish()


def handle(request: ClientRequest, state: ProxyState) -> Coroutine[Any, Any, None] | None:
    """Begin one exchange. A request whose body is all here, with an idle upstream connection to send
    it on, is carried in the connections' callbacks (None: it calls `request.finish()` at its end);
    any other hands back the coroutine that runs it, as the connection's task."""
    cfg = state.config
    dialect = for_request(request.method, request.path)
    sent_id = request.headers.get(_REQUEST_ID)
    request_id = sent_id if sent_id is not None and client_request_id(sent_id) else new_request_id()
    ex = ExchangeRecord(request_id, request.method, request.path, dialect.name, request.remote)
    if sent_id is not None and sent_id != request_id:
        ex.client_request_id = sent_id  # logged escaped and cut; never echoed or sent upstream
    life = Lifecycle(ex, drain_on_abandon=cfg.on_abandon == "drain")
    flight = _Flight(request, state, ex, life, dialect)
    state.books.start(ex, request.headers)
    state.track(flight.interrupter, ex)
    interrupter = flight.interrupter
    request.on_departure(lambda: interrupter.fire(Cause.CLIENT_GONE))
    link = _quick_link(flight)
    if link is None:
        return _then(flight, _exchange(flight), finish=False)
    try:
        _send_now(flight, link)
    except Exception as exc:
        flight.link = flight.link or link  # (taken from the pool: closed, or given back, as it ended)
        if not _answer_now(flight, exc):
            flight.hand_over(_settle_ended(flight))
            return None
        flight.end()
    return None


def _quick_link(flight: _Flight) -> UpstreamLink | None:
    """An idle upstream connection when nothing before the upstream's head can wait: the body all
    here and within every bound at once, no `100-continue` to answer, not shutting down, no drain;
    else None (the exchange runs as a task)."""
    request, state = flight.request, flight.state
    if state.draining or flight.life.drain_on_abandon or not request.content.whole or "Expect" in request.headers:
        return None
    announced = request.content_length
    if announced is None:
        if "Transfer-Encoding" in request.headers:
            return None  # (a chunked body is reserved as it comes, which may wait)
    elif announced > state.config.max_body_size or not state.body_budget.fits(announced):
        return None
    return state.upstream.take_idle()


def _send_now(flight: _Flight, link: UpstreamLink) -> None:
    """`_exchange`'s steps up to the request sent, in this call (nothing can wait: `_quick_link`);
    the head (or why none came, a first-byte timeout too) reaches the flight's `on_head` (`on_failure`)."""
    state, request, cfg, interrupter = flight.state, flight.request, flight.state.config, flight.interrupter
    target = upstream_target(request)
    headers, data = _request_steps(flight, target, _at_once(_read(flight)))
    flight.link = link
    state.upstream.send_on(link, request.method, target, headers, data, flight, within=cfg.first_byte_timeout)
    interrupter.watch(flight._interrupted)


async def _read(flight: _Flight) -> bytes | bytearray:
    request, state = flight.request, flight.state
    content = request.content
    flight.interrupter.watch(lambda cause: content.set_exception(Interrupted(cause)))
    return await read_body(request, state.config, state.body_budget, flight.ex)


def _request_steps(
    flight: _Flight, target: str, body: bytes | bytearray
) -> tuple[CIMultiDict[str], bytes | bytearray | None]:
    """The request as it goes upstream (its headers and body), its facts noted; the lifecycle told it
    is sent."""
    request, state, ex, dialect = flight.request, flight.state, flight.ex, flight.dialect
    info, resumer = _read_request(state.config, dialect, body, request.headers.get("Content-Encoding"))
    flight.info, flight.resumer = info, resumer
    ex.model, ex.stream = info.model, info.stream
    headers = upstream_headers(request, state, dialect, ex)
    data = body if body or request.method not in _NO_BODY_METHODS else None
    if resumer is not None:
        flight.target, flight.headers = target, headers  # (a continuation resends them)
    flight.life.sent()
    return headers, data


def _at_once(work: Coroutine[Any, Any, _T]) -> _T:
    """Run a step that cannot wait here (each of its waits' conditions is met: it completes on its
    first send) and return its result; its exceptions are the step's."""
    try:
        work.send(None)
    except StopIteration as done:
        return cast(_T, done.value)
    work.close()
    raise RuntimeError("a step run at once waited")


def _whole_at_once(flight: _Flight, reader: BodyReader) -> bool:
    """A whole body all here (or failed), small, for a client whose socket takes it without a wait:
    `respond_whole` and the reply complete in this call."""
    if not reader.settled or reader.size > _AT_ONCE_BYTES:
        return False
    transport = flight.request.channel.transport
    return transport is None or (not flight.out.paused and transport.get_write_buffer_size() == 0)


async def _then(flight: _Flight, work: Coroutine[Any, Any, None], *, finish: bool) -> None:
    """Run the exchange's steps (or the rest of them) as a task: every ending the lifecycle's, carried
    out, then the books (and, `finish`, the connection told)."""
    life = flight.life
    try:
        try:
            await work
        except asyncio.CancelledError:  # shutdown's final cleanup cut this one
            life.interrupted()
            raise
        except Exception as exc:
            if not _answer_now(flight, exc):
                await _settle_ended(flight)
    finally:
        if finish:
            flight.end()
        else:
            _finish(flight)


async def _settle_ended(flight: _Flight) -> None:
    answer = flight.life.ended
    assert answer is not None
    await settle(flight.out, answer)


def _answer_now(flight: _Flight, exc: Exception) -> bool:
    """What ended the exchange's steps, as the lifecycle's event, its answer carried out; True when
    done, False when the client must first take it in (`settle`). The one road for both ways an
    exchange runs (a task, or callbacks)."""
    state, ex, life = flight.state, flight.ex, flight.life
    try:
        if isinstance(exc, Refusal):
            ex.cause = exc.message[:_CAUSE_MAX]
            return _tell_now(flight, life.refused(exc.reason), exc.message, exc.headers)
        if isinstance(exc, UpstreamFailure):
            ex.cause = exc.message[:_CAUSE_MAX]  # the client got it; the log line says it too
            return _tell_now(flight, life.upstream_failed(exc.reason), exc.message)
        if isinstance(exc, Interrupted):  # shutdown, or the client's departure, inside the wait it was in
            return _tell_now(flight, told(life, exc.cause), _SHUTTING_DOWN)
        if isinstance(exc, ClientStalled):
            return _tell_now(flight, life.client_stalled(), "")
        if isinstance(exc, ConnectionError):  # a write found the client's socket closed before its close was noticed
            return _tell_now(flight, life.client_gone(), "")
        answer = life.bug()
        state.books.logger.exception("proxy_error", request_id=ex.request_id)  # (inside the caller's except)
        return _tell_bug_now(flight, answer)
    except (ClientStalled, ConnectionError):  # the telling failed: the verdict stands, the client is cut
        flight.out.cut()
    except Exception:
        state.books.logger.exception("proxy_error", request_id=ex.request_id)
        flight.out.cut()
    return True


def _finish(flight: _Flight) -> None:
    """The exchange is over: its body budget back, the upstream released (or drained), the books."""
    state, ex, request = flight.state, flight.ex, flight.request
    state.body_budget.give_back(ex.body_reserved)
    ex.body_reserved = 0
    flight.out.release_flow()
    ended = flight.life.ended
    if ended is not None and ended.drain:  # --on-abandon drain: the upstream is read on, not cancelled
        _hand_over_to_drain(state, flight)
    if not flight.handed_over:  # (else the drain task does this when it is done)
        _release_upstream(state, flight)
        state.untrack(flight.interrupter)
        state.books.finish(ex)
        state.cancel_hooks.fire(ex, request.headers)  # --cancel-hook: after a cancelled upstream
        flight.interrupter.forget()  # no cycle outlives the exchange: refcounting frees it, not the GC
    request.on_departure(None)


async def _exchange(flight: _Flight) -> None:
    state, request, cfg, life = flight.state, flight.request, flight.state.config, flight.life
    if state.draining:
        raise Refusal(Reason.SHUTDOWN, _SHUTTING_DOWN)
    target = upstream_target(request)
    headers, data = _request_steps(flight, target, await _read(flight))
    try:
        with Deadline(state.loop, cfg.first_byte_timeout) as deadline:
            flight.interrupter.watch_deadline(deadline)
            sending = state.upstream.request(request.method, target, headers, data)
            if life.drain_on_abandon:  # the request must outlive this handler if its client leaves
                flight.sending = asyncio.ensure_future(sending)
                link, head = await asyncio.shield(flight.sending)
            else:
                link, head = await sending
            flight.link = link
    except TimeoutError as exc:
        if flight.interrupter.fired:
            raise flight.interrupter.error() from exc
        raise first_byte_timeout(cfg.first_byte_timeout) from None
    # (what only the request needed is not kept while a stream runs)
    del data, sending, deadline, headers
    if _headed(flight, head):
        return await _streamed(flight)
    flight.reader = BodyReader(link)
    await _whole(flight)


def _headed(flight: _Flight, head: UpstreamHead) -> bool:
    """The upstream's head came: the lifecycle told, the request's bytes let go; True for a stream
    (its guard made), False for a whole body. Raises an `UpstreamFailure` for a status not passed on."""
    state, ex, life, resumer = flight.state, flight.ex, flight.life, flight.resumer
    flight.head = head
    # The body has gone upstream: its bytes no longer count against the shared bound (unless
    # --resume-on-cut keeps them for a continuation: then they count until the exchange ends).
    if resumer is None or not resumer.possible:
        state.body_budget.give_back(ex.body_reserved)
        ex.body_reserved = 0
    ex.upstream_status = head.status
    if not 200 <= head.status <= 599:  # an unrequested 101 (Upgrade is hop-by-hop, never sent), or junk
        message = f"the upstream answered with status {head.status}, which is not passed on"
        raise UpstreamFailure(Reason.BAD_UPSTREAM_RESPONSE, message)
    stream = is_stream(head)
    life.headers_received(stream=stream)
    if not stream:
        return False
    cfg = state.config
    ex.stream = True
    may_resume = resumer.may_resume if resumer is not None else None
    flight.guard = StreamGuard(
        flight.dialect, hold=cfg.hold_headers > 0, max_event_size=cfg.max_event_size, may_resume=may_resume
    )
    return True


async def _streamed(flight: _Flight) -> None:
    state, ex, resumer, guard = flight.state, flight.ex, flight.resumer, flight.guard
    assert flight.link is not None
    assert flight.head is not None
    assert guard is not None
    resuming = None
    if resumer is not None:
        if resumer.possible:  # (else every break is refused: no transcript to keep)
            resumer.watch(guard.stream)
        ex.resumer = resumer
        assert flight.headers is not None
        resuming = _resuming(state, flight, resumer, flight.target, flight.headers)
    flight.headers = None
    await relay_stream(
        flight.link, flight.head, guard, flight.out, flight.life, ex, state.config, flight.interrupter, resuming
    )


async def _respond(flight: _Flight) -> Answer | None:
    cfg, reader, head, info = flight.state.config, flight.reader, flight.head, flight.info
    assert reader is not None
    assert head is not None
    assert info is not None
    return await respond_whole(
        reader, head, flight.out, flight.life, flight.ex, flight.dialect, info, flight.interrupter,
        max_body_size=cfg.max_body_size, idle_timeout=cfg.idle_timeout,
    )


async def _whole(flight: _Flight) -> None:
    await _tell(flight, await _respond(flight), "")


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


def _tell_now(
    flight: _Flight, answer: Answer | None, message: str, headers: dict[str, str] | None = None,
    failure: Failure | None = None,
) -> bool:
    """Carry out an ending's answer (`proxy.exchange.reply`); True when done, False when the client
    must first take it in (`settle`). A STATUS is worded by `message` or, when the guard worded it, by
    its `failure`."""
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
        return True
    if go_on:
        assert answer is not None
        return settle_now(out, answer)
    return True


async def _tell(
    flight: _Flight, answer: Answer | None, message: str, headers: dict[str, str] | None = None,
) -> None:
    """`_tell_now`, and the client let take the reply in."""
    if not _tell_now(flight, answer, message, headers):
        assert answer is not None
        await settle(flight.out, answer)


def _tell_bug_now(flight: _Flight, answer: Answer | None) -> bool:
    """A bug of ours: a 500 in the dialect's shape, an error frame in a stream, else a cut; never a traceback."""
    guard, failure = flight.guard, None
    if guard is not None and answer is not None and answer.reply is Reply.STATUS:
        try:
            failure = guard.fail(Reason.PROXY_ERROR).failure  # the dialect's own error, as the guard words it
        except Exception:  # the guard itself is what broke
            flight.out.cut()
            return True
    try:
        return _tell_now(flight, answer, "the proxy failed to handle the request", failure=failure)
    except Exception:  # the guard itself is what broke
        flight.out.cut()
        return True


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
