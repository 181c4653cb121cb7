"""What the fake upstream saw: one record per request, and a way to wait for it.

Tests use this to see cancellation from the backend's side: a proxy that closes its upstream connection
when the client leaves shows up here as a record whose ``client_closed_at`` is set and whose
``events_sent`` is short of the full stream. Waiting is event-driven (``wait_started``,
``wait_finished``), so tests never sleep and hope.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from typing import Any

from aiohttp import web

__all__ = ["RECORDER", "Recorder", "RequestRecord"]

#: How many records a long-running fake keeps; the oldest are forgotten first.
MAX_RECORDS = 10_000


@dataclass
class RequestRecord:
    """One request as the fake upstream handled it.

    Times are ``time.monotonic()`` values. ``client_closed_at`` is set when the handler noticed that its
    peer closed the connection (the handler was cancelled, or a write hit a closing transport).
    ``completed`` is true when the handler ran its whole script (normal or faulty) without the peer
    leaving first.
    """

    request_id: str
    method: str
    path: str
    scenario: str | None = None
    api: str = "other"
    stream: bool = False
    started_at: float = field(default_factory=time.monotonic)
    events_sent: int = 0
    finished_at: float | None = None
    client_closed_at: float | None = None
    completed: bool = False
    headers: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A plain dict for ``GET /_fake/requests``."""
        return asdict(self)


class _Waiters:
    """The two events one request id can be waited on for."""

    __slots__ = ("finished", "started")

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.finished = asyncio.Event()


class Recorder:
    """Per-app store of request records (kept under ``app[RECORDER]``, never global).

    A request id seen twice (a retried request that reuses its ``X-Request-Id``) maps to its latest
    attempt; ``all()`` still lists every attempt.
    """

    def __init__(self, max_records: int = MAX_RECORDS) -> None:
        self._max = max_records
        self._records: deque[RequestRecord] = deque()
        self._latest: OrderedDict[str, RequestRecord] = OrderedDict()
        self._waiters: dict[str, _Waiters] = {}

    def get(self, request_id: str) -> RequestRecord | None:
        return self._latest.get(request_id)

    def all(self) -> list[RequestRecord]:
        return list(self._records)

    async def wait_started(self, request_id: str, timeout: float = 5.0) -> RequestRecord:  # noqa: ASYNC109
        """Return once a request with this id has been received; raise ``TimeoutError`` otherwise."""
        async with asyncio.timeout(timeout):
            await self._waiter(request_id).started.wait()
        return self._latest[request_id]

    async def wait_finished(self, request_id: str, timeout: float = 5.0) -> RequestRecord:  # noqa: ASYNC109
        """Return once that request's handler has ended; raise ``TimeoutError`` otherwise."""
        async with asyncio.timeout(timeout):
            await self._waiter(request_id).finished.wait()
        return self._latest[request_id]

    # -- used by the server -------------------------------------------------------------------------

    def begin(self, record: RequestRecord) -> None:
        """Store a new record and wake ``wait_started`` callers."""
        waiters = self._waiter(record.request_id)
        if waiters.finished.is_set():  # an earlier attempt with the same id: wait for this one now
            waiters.finished = asyncio.Event()
        self._records.append(record)
        self._latest[record.request_id] = record
        self._latest.move_to_end(record.request_id)
        waiters.started.set()
        self._evict()

    def client_closed(self, record: RequestRecord) -> None:
        """Note the first moment the handler saw its peer go away."""
        if record.client_closed_at is None:
            record.client_closed_at = time.monotonic()

    def finish(self, record: RequestRecord, *, completed: bool) -> None:
        """Close the record (once) and wake ``wait_finished`` callers."""
        if record.finished_at is not None:
            return
        record.finished_at = time.monotonic()
        record.completed = completed and record.client_closed_at is None
        if self._latest.get(record.request_id) is record:
            self._waiter(record.request_id).finished.set()

    def _waiter(self, request_id: str) -> _Waiters:
        waiters = self._waiters.get(request_id)
        if waiters is None:
            waiters = self._waiters[request_id] = _Waiters()
        return waiters

    def _evict(self) -> None:
        while len(self._records) > self._max:
            old = self._records.popleft()
            if self._latest.get(old.request_id) is old:
                del self._latest[old.request_id]
                self._waiters.pop(old.request_id, None)


RECORDER: web.AppKey[Recorder] = web.AppKey("fake_recorder", Recorder)
