"""`Deadline` keeps `asyncio.timeout`'s contract: a TimeoutError at the block's end when it expired,
a cancel from elsewhere stays a cancel, and moving it to now ends the wait (the interrupter's use)."""

from __future__ import annotations

import asyncio

import pytest

from proxy.exchange.deadline import Deadline


async def test_an_expired_deadline_raises_timeout_error() -> None:
    loop = asyncio.get_running_loop()
    deadline = Deadline(loop, 0)

    async def wait() -> None:
        async with deadline:
            await loop.create_future()  # never set: only the deadline ends it

    with pytest.raises(TimeoutError):
        await wait()
    assert deadline.expired()


async def test_a_block_that_ends_in_time_is_left_alone() -> None:
    loop = asyncio.get_running_loop()
    async with Deadline(loop, 60) as deadline:
        await asyncio.sleep(0)
    assert not deadline.expired()
    with pytest.raises(RuntimeError):
        deadline.reschedule(loop.time())  # (the block is over: nothing to move)


async def test_moving_it_to_now_ends_the_wait() -> None:
    loop = asyncio.get_running_loop()

    async def wait() -> None:
        async with Deadline(loop, 60) as deadline:
            loop.call_soon(lambda: deadline.reschedule(loop.time()))
            await loop.create_future()

    with pytest.raises(TimeoutError):
        await wait()


async def test_no_deadline_never_expires() -> None:
    loop = asyncio.get_running_loop()
    async with Deadline(loop, None) as deadline:
        await asyncio.sleep(0)
    assert deadline.when() is None
    assert not deadline.expired()


async def test_a_cancel_from_elsewhere_stays_a_cancel() -> None:
    loop = asyncio.get_running_loop()
    entered = asyncio.Event()

    async def wait() -> None:
        async with Deadline(loop, 60):
            entered.set()
            await loop.create_future()

    task = asyncio.ensure_future(wait())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_outer_cancel_at_expiry_is_not_swallowed() -> None:
    loop = asyncio.get_running_loop()
    entered = asyncio.Event()

    async def wait() -> None:
        async with Deadline(loop, 60) as deadline:
            entered.set()
            deadline.reschedule(loop.time())
            asyncio.current_task().cancel()  # type: ignore[union-attr]  # a second cancel: not ours
            await loop.create_future()

    task = asyncio.ensure_future(wait())
    await entered.wait()
    with pytest.raises(asyncio.CancelledError):
        await task
