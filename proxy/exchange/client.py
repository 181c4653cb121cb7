"""What an exchange sees of its client: the request (head and body) and the connection it came on.

The main port's connections (proxy/server/connections.py) parse requests with llhttp and hand each
one to the exchange as a `ClientRequest`; its body arrives in a `ClientBody` from the connection's
callbacks (with the transport's flow control: past 64 KiB unread the connection stops reading). The
exchange answers through the `ClientChannel`, the connection itself, never through a framework
response object.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from multidict import CIMultiDictProxy

__all__ = ["BODY_HIGH_WATER", "ClientBody", "ClientChannel", "ClientRequest"]

BODY_HIGH_WATER = 64 * 1024
_Hook = Callable[[], None]


class ClientChannel(Protocol):
    """The client's connection, as the exchange writes to it."""

    transport: asyncio.Transport | None
    writing_paused: bool
    flow_hooks: tuple[_Hook, _Hook] | None

    async def drain(self) -> None:
        """Until the transport's buffer is below its low-water mark again (at once when it is)."""

    def close_now(self) -> None:
        """Close after what was written, without reading the rest of the request's body."""

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class ClientBody:
    """A request's body as it arrives; read by the exchange (`read_nowait`, `readany`)."""

    __slots__ = ("_channel", "_eof", "_error", "_paused", "_pieces", "_size", "_waiter")

    def __init__(self, channel: ClientChannel) -> None:
        self._channel = channel
        self._pieces: list[bytes] = []
        self._size = 0
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    # ---- the connection's side ----------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        self._pieces.append(data)
        self._size += len(data)
        if self._size > BODY_HIGH_WATER and not self._paused:
            self._paused = True
            self._channel.pause_reading()
        self._wake()

    def feed_eof(self) -> None:
        self._eof = True
        self._wake()

    def set_exception(self, error: BaseException) -> None:
        """The next (or the current) read raises `error`: the client left, or shutdown came."""
        if self._error is None:
            self._error = error
        self._wake()

    # ---- the exchange's side ------------------------------------------------------------------------

    def is_eof(self) -> bool:
        """The body was received to its end (what the framing announced)."""
        return self._eof

    def at_eof(self) -> bool:
        return self._eof and not self._pieces

    def read_nowait(self) -> bytes:
        if self._error is not None:
            raise self._error
        if not self._pieces:
            return b""
        pieces, self._pieces, self._size = self._pieces, [], 0
        if self._paused:
            self._paused = False
            self._channel.resume_reading()
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    async def readany(self) -> bytes:
        """What came since the last read, waiting for it if nothing did; b"" at the end."""
        while not self._pieces and not self._eof and self._error is None:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        return self.read_nowait()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class ClientRequest:
    """One request as the main port parsed it."""

    __slots__ = ("_on_departure", "channel", "content", "content_length", "departed", "headers", "keep_alive",
                 "method", "path", "raw_path", "remote", "version")  # fmt: skip

    def __init__(
        self, channel: ClientChannel, method: str, raw_path: str, path: str, version: tuple[int, int],
        headers: CIMultiDictProxy[str], *, remote: str | None, keep_alive: bool,
    ) -> None:
        self.channel = channel
        self.method = method
        self.raw_path = raw_path  # the request target as sent (origin or absolute form)
        self.path = path  # its path, percent-decoded (for the dialect and the log line)
        self.version = version
        self.headers = headers
        self.remote = remote
        self.keep_alive = keep_alive  # the client's framing allows another request after this one
        self.content = ClientBody(channel)
        length = headers.get("Content-Length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        self.departed = False
        self._on_departure: _Hook | None = None

    def on_departure(self, hook: _Hook) -> None:
        """`hook` is the exchange's: called when the client leaves (at once if it has)."""
        self._on_departure = hook
        if self.departed:
            hook()

    def depart(self) -> None:
        """The client's connection closed: an event to the exchange, not a cancel of its task."""
        if not self.departed:
            self.departed = True
            if self._on_departure is not None:
                self._on_departure()

    @property
    def scheme(self) -> str:
        return "http"
