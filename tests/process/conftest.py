"""Fixtures of the process tier that several modules ask for by the same name."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.hostile import FakeProcess


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeProcess]:
    """The fake upstream as its own process, one per module: `serve` processes point at it."""
    process = FakeProcess()
    yield process
    process.stop()
