"""Request ids: 32 random hex digits, as `uuid4().hex` gives, without a system call per request.

`uuid.uuid4()` reads 16 bytes from the kernel (`getrandom`) for every exchange, and builds a UUID
object only to print it. Here the kernel's random bytes are read 4 KiB at a time and cut into ids
(one `getrandom` per 256 requests): each id is still 128 bits from the OS's CSPRNG, unguessable and
unique across workers and restarts (a counter with a per-process prefix would be cheaper still, but
would let a client who sees one id predict the next ones). A forked child drops its parent's
buffer, so that two processes never hand out the same ids.
"""

from __future__ import annotations

import os

__all__ = ["new_request_id"]

_ID_BYTES = 16
_BATCH = 256 * _ID_BYTES


class _RandomIds:
    __slots__ = ("_at", "_pool")

    def __init__(self) -> None:
        self._pool = b""
        self._at = 0

    def next(self) -> str:
        at = self._at
        if at >= len(self._pool):
            self._pool, at = os.urandom(_BATCH), 0
        self._at = at + _ID_BYTES
        return self._pool[at : at + _ID_BYTES].hex()

    def forget(self) -> None:
        self._pool, self._at = b"", 0


_IDS = _RandomIds()
os.register_at_fork(after_in_child=_IDS.forget)
new_request_id = _IDS.next
