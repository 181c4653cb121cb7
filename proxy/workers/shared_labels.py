"""`--model-label-limit` across the workers of `--workers N`: one limit for the set, as for one process.

Each worker seeing its own first 50 names would let N x 50 model labels into the merged metrics, and
which names kept a label would depend on which worker a client happened to reach. So the names that
get a label (past the upstream's own, which every worker knows) are admitted in one small file next
to the metrics files, under an exclusive `flock`: the first `limit` distinct names the set sees keep
their label, the rest are `other`, in every worker. A worker touches the file only for a name it has
not met yet, and never again once the file is full, so the steady state costs nothing.
"""

from __future__ import annotations

import fcntl
import os

import orjson

from proxy.observe.metrics import ModelLabels

__all__ = ["SharedModelLabels"]

_FILE_NAME = "model-labels.jsonl"  # not `*.db`: prometheus_client's merge reads only those


class SharedModelLabels(ModelLabels):
    """`ModelLabels` whose admitted names live in `directory`, shared with the other workers."""

    def __init__(self, limit: int, directory: str) -> None:
        super().__init__(limit)
        self._path = os.path.join(directory, _FILE_NAME)
        self._full = False

    def _admit(self, name: str) -> str:
        if self._full:
            return "other"
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by the close
            admitted = [orjson.loads(line) for line in _read_all(fd).splitlines() if line]
            self._seen.update(admitted)
            if name not in self._seen and len(admitted) < self._limit:
                os.write(fd, orjson.dumps(name) + b"\n")
                self._seen.add(name)
                admitted.append(name)
            self._full = len(admitted) >= self._limit
        finally:
            os.close(fd)
        return name if name in self._seen else "other"


def _read_all(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks: list[bytes] = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)
