"""Tasks that outlive the handler that started them (a drain), kept referenced and ended on shutdown."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

__all__ = ["Background"]


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self, grace: float = 0.0) -> None:
        """Give what still runs up to `grace` seconds, then cancel it and wait for it to unwind (its
        `finally` writes its books)."""
        if self._tasks and grace > 0:
            await asyncio.wait(set(self._tasks), timeout=grace)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
