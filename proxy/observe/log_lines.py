"""The file the log's lines go to, in a module of its own so that a compiled build leaves it
interpreted: structlog keys its write lock by a weak reference to the file, which a compiled class
cannot take (scripts/mypyc_build.py lists it among those left out).
"""

from __future__ import annotations

import asyncio
import threading
from typing import TextIO

__all__ = ["Lines"]


class Lines:
    """The file the lines go to (structlog's `WriteLogger` writes to it too, so that the order
    holds): written through, or held on an event loop and written once per turn."""

    __slots__ = ("__weakref__", "_file", "_held", "_loop", "_thread")  # (structlog keys its lock by a weak one)

    def __init__(self, file: TextIO) -> None:
        self._file = file
        self._held: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = 0

    def write(self, text: str) -> None:
        if self._loop is None or threading.get_ident() != self._thread:
            self._file.write(text)
            self._file.flush()
            return
        if not self._held:
            self._loop.call_soon(self.write_held)  # (once, early in the next turn)
        self._held.append(text)

    def flush(self) -> None:
        """structlog's flush after each line: a no-op while lines are held (the turn's write flushes)."""
        if self._loop is None:
            self._file.flush()

    def write_held(self) -> None:
        if self._held:
            held, self._held = self._held, []
            self._file.write("".join(held))
            self._file.flush()

    def hold(self, loop: asyncio.AbstractEventLoop) -> None:
        self.write_held()
        self._loop, self._thread = loop, threading.get_ident()

    def release(self) -> None:
        self._loop = None
        self.write_held()
