"""Carrying out a lifecycle `Answer`: the one place where a verdict becomes what the client is told.

The lifecycle (proxy/core/lifecycle.py) decides; this module does what its `Reply` says:

- `NOTHING`: no byte more. The client already has its answer (a body or a stream ended), or it left,
  and then its socket is dropped (`Close.NOW`).
- `STATUS`: a whole error response in the dialect's shape (nothing was committed), with the status
  the answer names; the exchange's `X-Request-Id` comes from the writer, like on every response.
  `write_error` writes it, and every error the proxy words goes out through it: a verdict's status,
  the stream guard's failure, a bug's 500, a connection's refusal, a whole body the judge replaced.
- `FRAME`: the stream's error frame, the bytes the stream guard made of the failure, then the
  body's end.
- `CUT`: the connection is dropped without another byte: a committed plain body cannot carry a
  second response, and a stalled client is not waited for.

Then `settle` waits for the client to take the reply in and closes the connection as the answer's
`close` says: kept for the next request, `Connection: close` after the reply, or closed now.

No answer (`None`) means an earlier ending fixed the verdict and its reply was carried out then;
whatever failed afterwards can only be met by dropping the connection.

Connection-level refusals (too many connections, a head llhttp rejects or that is too large, a
method or version nginx refuses, a head that does not arrive in time) go through a lifecycle too:
`refuse_connection` makes the exchange record, takes the `refused` verdict and books it, so that
they are counted and logged by the same code as any other exchange.
"""

from __future__ import annotations

from collections.abc import Mapping

from multidict import CIMultiDict, CIMultiDictProxy

from proxy.core.dialects import DIALECTS, Dialect
from proxy.core.guard import Failure
from proxy.core.lifecycle import Answer, Close, Lifecycle, Reason, Reply
from proxy.core.record import ExchangeRecord
from proxy.exchange.client import ClientChannel, ClientRequest
from proxy.exchange.client_writer import ClientStalled, ClientWriter
from proxy.observe.books import Books
from proxy.observe.request_ids import new_request_id

__all__ = ["carry_out", "refuse_connection", "settle", "settle_now", "write_error"]

_OTHER = DIALECTS["other"]
_NO_HEADERS: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())


def carry_out(
    out: ClientWriter,
    answer: Answer | None,
    *,
    dialect: Dialect,
    message: str = "",
    headers: Mapping[str, str] | None = None,
    frame: bytes = b"",
    failure: Failure | None = None,
) -> bool:
    """Do what `answer` says; True when the connection stays up for `settle` (the client to take it in).

    `message` (and `headers`) are for a STATUS the proxy words itself; `failure` is a STATUS the
    stream guard worded (its status, body and retry headers); `frame` for a FRAME. Writes are handed
    to the transport here, from a coroutine or a protocol callback alike; the waiting is `settle`'s.
    """
    if answer is None:
        out.cut()
        return False
    reply = answer.reply
    if reply is Reply.CUT or (reply is Reply.NOTHING and answer.close is Close.NOW):
        out.cut()  # a stalled client is not waited for; a departed one's socket is dropped
        return False
    if reply is Reply.NOTHING:
        return True
    if reply is Reply.FRAME:
        if frame:
            out.write_raw(frame)
        return True
    close = answer.close is not Close.KEEP
    if failure is not None:
        write_error(out, failure.status, failure.body, {**failure.headers, **(headers or {})}, close=close)
        return True
    body = dialect.error_body(answer.status, message, answer.reason)
    write_error(out, answer.status, body, headers or {}, close=close)
    return True


def write_error(
    out: ClientWriter, status: int, body: bytes, headers: Mapping[str, str], *, close: bool = False
) -> None:
    """The proxy's own error response (nothing was committed): `status`, the dialect's error JSON,
    `headers` besides the writer's own, and `Connection: close` when the connection closes after it.
    Handed to the transport at once; the waiting for the client to take it is `settle`'s."""
    out.whole_now(status, body, headers, close=close)


async def settle(out: ClientWriter, answer: Answer) -> None:
    """After `carry_out`: the body's end (a stream's last chunk), the client taking the reply in, and
    the connection's close as the answer's `close` says."""
    if settle_now(out, answer):
        return
    try:
        await out.drained()
    except (ClientStalled, ConnectionError):  # the verdict stands; the client simply did not take it
        out.cut()
        return
    if answer.close is Close.NOW:
        out.close_now()


def settle_now(out: ClientWriter, answer: Answer) -> bool:
    """`settle` when there is nothing to wait for (the common case: no coroutine): True when done,
    False when the client must first take the reply in (then `await settle`)."""
    try:
        out.finish_now()
    except ConnectionError:  # the verdict stands; the client simply did not take it
        out.cut()
        return True
    if out.paused:
        return False
    if answer.close is Close.NOW:
        out.close_now()
    return True


def refuse_connection(
    channel: ClientChannel, books: Books, reason: Reason, message: str, *, status: int = 0, remote: str | None
) -> Answer:
    """Refuse on a connection with no request in progress: a lifecycle's `refused` verdict, its
    status written to the socket (the caller closes it), and the books written once."""
    request = ClientRequest(channel, "-", "-", "-", (1, 1), _NO_HEADERS, remote=remote, keep_alive=False)
    ex = ExchangeRecord(new_request_id(), "-", "-", _OTHER.name, remote)
    life = Lifecycle(ex)
    books.start(ex)
    answer = life.refused(reason, status)
    assert answer is not None  # (a fresh lifecycle: the first ending)
    headers = {"Retry-After": "1"} if answer.status == 503 else None
    ex.status = answer.status  # (booked as answered even when the client left before the write)
    transport = channel.transport
    try:
        if transport is not None and not transport.is_closing():
            carry_out(ClientWriter(request, ex, life, 0.0), answer, dialect=_OTHER, message=message,
                      headers=headers)  # fmt: skip
    finally:
        books.finish(ex)
    return answer
