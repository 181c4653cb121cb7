"""Carrying out a lifecycle `Answer`: the one place where a verdict becomes what the client is told.

The lifecycle (proxy/core/lifecycle.py) decides; this module does what its `Reply` says:

- `NOTHING`: no byte more. The client already has its answer (a body or a stream ended), or it left,
  and then its socket is dropped.
- `STATUS`: a whole error response in the dialect's shape (nothing was committed), with the status
  the answer names; the exchange's `X-Request-Id` comes from the writer, like on every response.
- `FRAME`: the stream's error frame, the bytes the stream guard made of the failure, then the
  body's end.
- `CUT`: the connection is dropped without another byte: a committed plain body cannot carry a
  second response, and a stalled client is not waited for.

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
from proxy.core.lifecycle import Answer, Lifecycle, Reason, Reply
from proxy.core.record import ExchangeRecord
from proxy.exchange.client import ClientChannel, ClientRequest
from proxy.exchange.client_io import ClientWriter
from proxy.observe.books import Books
from proxy.observe.request_ids import new_request_id

__all__ = ["carry_out", "refuse_connection"]

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
    close: bool = False,
) -> bool:
    """Do what `answer` says; True when a whole response went out that the writer should see taken in.

    `message` (and `headers`) are for a STATUS, `frame` for a FRAME; `close`: the connection closes
    after a STATUS. Writes are handed to the transport here; waiting for the client is the caller's.
    """
    if answer is None:
        out.cut()
        return False
    reply = answer.reply
    if reply is Reply.NOTHING:
        if answer.reason is Reason.CLIENT_DISCONNECT:
            out.cut()  # its socket is dropped, not closed politely (idempotent: it is mostly gone already)
        return False
    if reply is Reply.CUT:
        out.cut()
        return False
    if reply is Reply.FRAME:
        if frame and out.write_raw(frame):
            out.ex.bytes_out += len(frame)
        return True
    body = dialect.error_body(answer.status, message, answer.reason)
    out.whole_now(answer.status, body, headers or {}, close=close)
    out.ex.bytes_out = len(body)
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
                      headers=headers, close=True)  # fmt: skip
    finally:
        books.finish(ex)
    return answer
