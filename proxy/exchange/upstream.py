"""What an exchange sees of the upstream: a response head, a body sink, a link and a pool.

The upstream connections are the server's (proxy/server/upstream_conn.py, upstream_pool.py); an
exchange only uses these small interfaces, so that the arrows point one way (server -> exchange).
A body arrives by callbacks into a `BodySink` (the stream relay writes each piece to the client
from there; a whole body is read through `BodyReader`), never by a task per piece.

`BodyReader` is the sink of a whole upstream body, read piece by piece by a coroutine with the
transport's flow control. The sink side is called by the upstream connection's callbacks; `read`
returns what has come (all of it, joined) and waits only when nothing has. Past `high_water` unread
bytes the connection stops reading, so a client that is slow to take a large body never makes the
proxy hold more than that. Each wait is bounded by the idle timeout (a body that trickles is not
cut while it moves), and shutdown's `interrupt` wakes it.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from multidict import CIMultiDict

from proxy.exchange.errors import UpstreamFailure, stalled
from proxy.exchange.flow import BodyBuffer

__all__ = ["HIGH_WATER", "BodyReader", "BodySink", "HeadReceiver", "UpstreamHead", "UpstreamLink", "UpstreamPool"]


class UpstreamHead:
    """The upstream's status line and headers (interim 1xx responses are skipped before it)."""

    # (A plain class with its own `__init__`, made once per request: compiled, a dataclass's generated
    # `__init__` runs as interpreted code.)
    __slots__ = ("content_length", "headers", "reason", "status")

    def __init__(self, status: int, reason: str, headers: CIMultiDict[str], content_length: int | None) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.content_length = content_length


class BodySink(Protocol):
    """Where an upstream body goes, piece by piece, from the connection's own callbacks."""

    def body(self, data: bytes) -> None: ...

    def end(self) -> None:
        """The body ended as its framing said (or at EOF, for a body framed by the close)."""

    def failed(self, failure: UpstreamFailure) -> None:
        """The body broke (a cut, bad framing); no more calls follow."""


class HeadReceiver(Protocol):
    """Who hears a response head from the connection's callbacks, instead of awaiting it (an exchange
    that needs no task: `proxy.exchange.handler`). Each is called once at most, after llhttp's feed."""

    def on_head(self, head: UpstreamHead) -> None: ...

    def on_failure(self, failure: UpstreamFailure) -> None:
        """No head will come (the connection closed or sent bad HTTP)."""


class UpstreamLink(Protocol):
    """One upstream connection, while an exchange holds it."""

    def attach(self, sink: BodySink) -> None:
        """Deliver the body (what already arrived first) to `sink` from now on."""

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    @property
    def complete(self) -> bool:
        """The response was read to its end: the connection may go back to the pool."""


class UpstreamPool(Protocol):
    async def request(
        self, method: str, target: str, headers: CIMultiDict[str], body: bytes | bytearray | None
    ) -> tuple[UpstreamLink, UpstreamHead]:
        """Send a request on a pooled or new connection; wait for the response head.

        Raises `UpstreamFailure` (connect failed, closed, bad HTTP). Not bounded in time: the
        caller's first-byte deadline bounds it; a cancel closes the connection.
        """

    def take_idle(self) -> UpstreamLink | None:
        """An idle connection ready for a request, taken out of the pool; None when none is (no wait)."""

    def send_on(
        self, link: UpstreamLink, method: str, target: str, headers: CIMultiDict[str],
        body: bytes | bytearray | None, receiver: HeadReceiver, *, within: float,
    ) -> None:
        """Send a request on `link` (from `take_idle`); its head, or why none came (a first-byte
        timeout after `within` seconds too), goes to `receiver`, which closes the link when it failed."""

    def release(self, link: UpstreamLink) -> None:
        """The exchange is done with it: back to the pool when complete and reusable, else closed."""

    def close_link(self, link: UpstreamLink) -> None:
        """Close it (cancelled, failed, or abandoned half-read)."""

    def close(self) -> None:
        """Shutdown: every connection closes."""


HIGH_WATER = 256 * 1024


class BodyReader(BodyBuffer):
    __slots__ = ("_tail_bytes", "tail")

    def __init__(self, link: UpstreamLink, high_water: int = HIGH_WATER) -> None:
        super().__init__(link, high_water)
        self.tail = b""  # the body's last bytes read, when asked to keep them
        self._tail_bytes = 0
        link.attach(self)

    # ---- BodySink -----------------------------------------------------------------------------------

    def body(self, data: bytes) -> None:
        self.put(data)

    def end(self) -> None:
        self.put_eof()

    def failed(self, failure: UpstreamFailure) -> None:
        self.set_exception(failure)

    def interrupt(self, error: BaseException) -> None:
        """The next (or the current) read raises `error` (a failure, or an `Interrupted`)."""
        self.set_exception(error)

    # ---- the reading coroutine's side ---------------------------------------------------------------

    def keep_tail(self, start: bytes, size: int) -> None:
        """From now on `tail` holds the last `size` bytes read (`start`: what was read before)."""
        self._tail_bytes = size
        self.tail = start[-size:]

    def read_now(self) -> bytes | None:
        """`read` when something (or the end) has come: no wait, no coroutine; None when it would wait."""
        return self._taken() if self.ready else None

    def _taken(self) -> bytes:
        data = self.take()
        if self._tail_bytes and data:
            size = self._tail_bytes
            self.tail = data[-size:] if len(data) >= size else (self.tail + data)[-size:]
        return data

    async def read(self, idle: float) -> bytes:
        """What came since the last read; b"" at the end. Raises the failure, or a stall after `idle` s."""
        if not self.ready:
            try:
                async with asyncio.timeout(idle):
                    await self.wait()
            except TimeoutError:
                raise stalled(idle) from None
        return self._taken()
