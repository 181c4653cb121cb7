"""What an exchange sees of the upstream: a response head, a body sink, a link and a pool.

The upstream connections are the server's (proxy/server/upstream_conn.py, upstream_pool.py); an
exchange only uses these small interfaces, so that the arrows point one way (server -> exchange).
A body arrives by callbacks into a `BodySink` (the stream relay writes each piece to the client
from there; a whole body is read through `BodyReader`), never by a task per piece.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from multidict import CIMultiDict

from proxy.exchange.errors import UpstreamFailure

__all__ = ["BodySink", "UpstreamHead", "UpstreamLink", "UpstreamPool"]


@dataclass(frozen=True, slots=True)
class UpstreamHead:
    """The upstream's status line and headers (interim 1xx responses are skipped before it)."""

    status: int
    reason: str
    headers: CIMultiDict[str]
    content_length: int | None


class BodySink(Protocol):
    """Where an upstream body goes, piece by piece, from the connection's own callbacks."""

    def body(self, data: bytes) -> None: ...

    def end(self) -> None:
        """The body ended as its framing said (or at EOF, for a body framed by the close)."""

    def failed(self, failure: UpstreamFailure) -> None:
        """The body broke (a cut, bad framing); no more calls follow."""


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

    def release(self, link: UpstreamLink) -> None:
        """The exchange is done with it: back to the pool when complete and reusable, else closed."""

    def close_link(self, link: UpstreamLink) -> None:
        """Close it (cancelled, failed, or abandoned half-read)."""

    def close(self) -> None:
        """Shutdown: every connection closes."""
