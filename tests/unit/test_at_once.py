"""`handler._at_once`: a step the callback path runs in one call must complete there; one that would
wait is closed and raised as a bug (a 500 by the one road), never left suspended."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from proxy.exchange.handler import _at_once


async def _done() -> int:
    return 7


async def _fails() -> int:
    raise ValueError("the step's own error")


def test_a_step_that_completes_gives_its_result() -> None:
    assert _at_once(_done()) == 7


def test_a_step_that_fails_raises_its_own_error() -> None:
    with pytest.raises(ValueError, match="the step's own error"):
        _at_once(_fails())


def test_a_step_that_would_wait_is_closed_and_raised() -> None:
    async def waits() -> int:
        await asyncio.sleep(0)  # (a bare yield to the loop: a wait)
        return 1

    step = waits()
    with pytest.raises(RuntimeError, match="waited"):
        _at_once(step)
    assert inspect.getcoroutinestate(step) == inspect.CORO_CLOSED  # not left suspended for the GC to find
