"""The multiprocess metrics directory of `serve --workers N`: made, held, and swept when left behind.

prometheus_client's multiprocess mode keeps every process's values in files of one directory. The
supervisor makes a fresh one under the temporary directory at start and removes it at exit; a
supervisor that was SIGKILLed (the OOM killer, a pod's grace period) cannot, and the manifest's `/tmp`
emptyDir outlives container restarts, so each restart would leave one more. So the supervisor holds
an exclusive `flock` on a file inside its directory for its whole life (the kernel drops it with the
process, however it dies; PIDs, reused by every container restart, cannot tell), and at start removes
every `streamwarden-metrics-*` directory whose lock it can take: their owners are gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["PREFIX", "MetricsDir", "sweep_stale"]

PREFIX = "streamwarden-metrics-"
_LOCK = ".owner.lock"


class MetricsDir:
    """A fresh directory, locked by this process until `remove`."""

    def __init__(self, parent: str | None = None) -> None:
        self.path = tempfile.mkdtemp(prefix=PREFIX, dir=parent)
        self._lock_fd = os.open(os.path.join(self.path, _LOCK), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new and ours: cannot be held

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)


def _owner_gone(directory: Path) -> bool:
    """Whether no live process holds the directory's lock (a directory without one: made by a
    streamwarden from before the lock, or half-made; its owner cannot be told, so only a lock counts)."""
    try:
        fd = os.open(directory / _LOCK, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its supervisor lives
        return False
    finally:
        os.close(fd)  # (closing drops the lock taken just now)
    return True


def sweep_stale(parent: str | None = None) -> list[str]:
    """Remove the metrics directories of supervisors that are gone; returns their paths."""
    root = Path(parent or tempfile.gettempdir())
    removed: list[str] = []
    try:
        candidates = [entry for entry in root.iterdir() if entry.name.startswith(PREFIX) and entry.is_dir()]
    except OSError:
        return removed
    for directory in candidates:
        if not directory.is_symlink() and _owner_gone(directory):
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(str(directory))
    return removed
