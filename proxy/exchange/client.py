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

from proxy.exchange.flow import BodyBuffer

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


class ClientBody(BodyBuffer):
    """A request's body as it arrives; read by the exchange (`read_nowait`, `readany`)."""

    __slots__ = ()

    def __init__(self, channel: ClientChannel) -> None:
        super().__init__(channel, BODY_HIGH_WATER)

    # ---- the connection's side ----------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        self.put(data)

    def feed_eof(self) -> None:
        self.put_eof()

    # ---- the exchange's side ------------------------------------------------------------------------

    def read_nowait(self) -> bytes:
        return self.take()

    async def readany(self) -> bytes:
        """What came since the last read, waiting for it if nothing did; b"" at the end."""
        await self.wait()
        return self.take()


class ClientRequest:
    """One request as the main port parsed it."""

    __slots__ = ("_on_departure", "channel", "content", "content_length", "departed", "finished", "headers",
                 "keep_alive", "method", "path", "raw_path", "remote", "task", "version")  # fmt: skip

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
        # (llhttp takes the value with trailing SP or TAB: so must the early 413 and the cutter)
        length = headers.get("Content-Length")
        length = length.rstrip(" \t") if length is not None else None
        self.content_length = int(length) if length is not None and length.isascii() and length.isdigit() else None
        self.departed = False
        self._on_departure: _Hook | None = None
        # An exchange carried in callbacks (no task of the connection's) calls `finished` once, at its
        # end; `task` is one it handed the rest to, where a wait was real (shutdown's last resort).
        self.finished: Callable[[ClientRequest], None] | None = None
        self.task: asyncio.Task[None] | None = None

    def on_departure(self, hook: _Hook | None) -> None:
        """`hook` is the exchange's: called when the client leaves (at once if it has); None when the
        exchange is over (the hook holds the exchange, which holds this request: a cycle)."""
        self._on_departure = hook
        if self.departed and hook is not None:
            hook()

    def finish(self) -> None:
        """The exchange carried in callbacks is over (once): the connection's next request may start."""
        hook, self.finished = self.finished, None
        self.task = None
        if hook is not None:
            hook(self)

    def depart(self) -> None:
        """The client's connection closed: an event to the exchange, not a cancel of its task."""
        if not self.departed:
            self.departed = True
            if self._on_departure is not None:
                self._on_departure()

    @property
    def scheme(self) -> str:
        return "http"
