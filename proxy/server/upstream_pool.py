"""The upstream keep-alive pool: connections on asyncio protocols, reused only when provably clean.

A connection goes back to the pool only when its response was read to its end, framed by length or
chunks, keep-alive, with no byte behind it (`UpstreamConnection` closes on any byte no request asked
for, and on anything else it cannot vouch for). An idle one is dropped after
`UPSTREAM_KEEPALIVE_SECONDS`, below uvicorn's 5 s, so the proxy lets go before the backend does and
never sends on a socket the backend is just closing.

`--upstream-max-connections N` bounds the connections (connecting, busy and idle); a request past it
waits for one to come free, bounded only by the exchange's first-byte deadline: the wait is not a
connect, so it never ends as a connect timeout.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque

from multidict import CIMultiDict
from yarl import URL

from proxy.core.lifecycle import Reason
from proxy.exchange.errors import UpstreamFailure
from proxy.exchange.upstream import HeadReceiver, UpstreamHead, UpstreamLink
from proxy.server.upstream_conn import UpstreamConnection, encode_request

__all__ = ["UPSTREAM_KEEPALIVE_SECONDS", "ConnectionPool"]

UPSTREAM_KEEPALIVE_SECONDS = 4.0


class ConnectionPool:
    """The one upstream's connections (`UpstreamPool` for the exchanges)."""

    def __init__(self, base_url: str, *, limit: int, connect_timeout: float,
                 keepalive: float = UPSTREAM_KEEPALIVE_SECONDS) -> None:  # fmt: skip
        url = URL(base_url)
        assert url.host is not None
        self._host, self._port = url.host, url.port or (443 if url.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if url.scheme == "https" else None
        default_port = url.port is None or url.is_default_port()
        host = f"[{url.host}]" if ":" in url.host else url.host
        self._host_header = host if default_port else f"{host}:{url.port}"
        self._prefix = url.raw_path.rstrip("/")
        self.limit = limit
        self.connect_timeout = connect_timeout
        self.keepalive = keepalive
        self._idle: list[UpstreamConnection] = []  # most recently used last
        self._idle_since: dict[UpstreamConnection, float] = {}  # (loop time) each idle one's release
        self._all: set[UpstreamConnection] = set()
        self._opening = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    @property
    def open_connections(self) -> int:
        return len(self._all) + self._opening

    async def request(
        self, method: str, target: str, headers: CIMultiDict[str], body: bytes | bytearray | None
    ) -> tuple[UpstreamLink, UpstreamHead]:
        connection = self._idle_one() or await self._acquire()
        head = encode_request(method, self._prefix + target, self._host_header, headers, body)
        try:
            answer = connection.send(head, body, head_only=method == "HEAD")
            assert answer is not None  # (no receiver: a future)
            return connection, await answer
        except BaseException:
            connection.close()
            raise

    def take_idle(self) -> UpstreamLink | None:
        return self._idle_one()

    def send_on(
        self, link: UpstreamLink, method: str, target: str, headers: CIMultiDict[str],
        body: bytes | bytearray | None, receiver: HeadReceiver, *, within: float,
    ) -> None:
        assert isinstance(link, UpstreamConnection)
        head = encode_request(method, self._prefix + target, self._host_header, headers, body)
        try:
            link.send(head, body, head_only=method == "HEAD", receiver=receiver, within=within)
        except BaseException:
            link.close()
            raise

    def release(self, link: UpstreamLink) -> None:
        assert isinstance(link, UpstreamConnection)
        link.detach()
        if not (link.complete and link.reusable) or self._closed:
            link.close()
            return
        link.resume_reading()  # idle, it must still hear a stray byte (and then close)
        now = self._idle_since[link] = link.loop.time()
        if link.idle_timer is None:  # (one left running from an earlier release is moved on when it fires)
            link.idle_timer = link.loop.call_at(now + self.keepalive, self._expire, link)
        self._idle.append(link)
        self._wake_one()

    def close_link(self, link: UpstreamLink) -> None:
        assert isinstance(link, UpstreamConnection)
        link.detach()
        link.close()

    def close(self) -> None:
        """Shutdown: every connection closes (the exchanges have finished or been interrupted)."""
        self._closed = True
        for connection in list(self._all):
            connection.close()
        self._idle.clear()
        self._idle_since.clear()

    # ---- internals --------------------------------------------------------------------------------

    def _idle_one(self) -> UpstreamConnection | None:
        """The newest idle connection that is still reusable (the others close), or None."""
        while self._idle:
            connection = self._idle.pop()
            self._idle_since.pop(connection, None)  # (its timer runs on: lazy, see `_expire`)
            if connection.complete and connection.reusable:
                return connection
            connection.close()
        return None

    async def _acquire(self) -> UpstreamConnection:
        while True:
            if (idle := self._idle_one()) is not None:
                return idle
            if not self.limit or self.open_connections < self.limit:
                return await self._connect()
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # the turn it was given passes on
                raise
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    async def _connect(self) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        self._opening += 1
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await loop.create_connection(
                    lambda: UpstreamConnection(self._lost), self._host, self._port, ssl=self._ssl,
                    server_hostname=self._host if self._ssl is not None else None,
                )
        except BaseException as exc:
            self._opening -= 1
            self._wake_one()  # the slot it held is free again
            if isinstance(exc, TimeoutError):
                message = f"the upstream did not connect within {self.connect_timeout:g} s"
                raise UpstreamFailure(Reason.FIRST_BYTE_TIMEOUT, message) from None
            if isinstance(exc, OSError):
                why = exc.strerror or "connection refused"
                raise UpstreamFailure(Reason.CONNECT_FAILED, f"could not connect to the upstream: {why}") from None
            raise
        self._opening -= 1
        self._all.add(connection)
        if self._closed:
            connection.close()
        return connection

    def _expire(self, connection: UpstreamConnection) -> None:
        """The idle timer: closes a connection idle for `keepalive` seconds. A connection's one timer
        outlives its reuses (set again for the rest when it comes early), rather than a timer made
        and cancelled per request."""
        connection.idle_timer = None
        since = self._idle_since.get(connection)
        if since is None:
            return  # in use: its next release sets a timer
        due = since + self.keepalive
        if connection.loop.time() < due:
            connection.idle_timer = connection.loop.call_at(due, self._expire, connection)
            return
        connection.close()

    def _lost(self, connection: UpstreamConnection) -> None:
        self._all.discard(connection)
        self._idle_since.pop(connection, None)
        if connection in self._idle:
            self._idle.remove(connection)
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
