"""Bounded calls (ftd.tasks.within): a cancel is never lost to a call's completion."""

from __future__ import annotations

import asyncio

import pytest

from ftd.tasks import within


async def test_a_cancel_that_lands_as_a_bounded_call_completes_is_kept() -> None:
    """Python 3.11's wait_for returned the result instead (a round's closer, cancelled as the
    round closed, then slept out the join timeout)."""
    loop = asyncio.get_running_loop()
    call: asyncio.Future[int] = loop.create_future()
    went_on = asyncio.Event()

    async def closer() -> None:
        await within(call, 30)
        went_on.set()

    task = asyncio.create_task(closer())
    await asyncio.sleep(0)  # the task awaits the call
    call.set_result(1)
    task.cancel()  # in the same loop turn as the call's completion
    await asyncio.wait({task}, timeout=30)
    assert task.cancelled() and not went_on.is_set()
    with pytest.raises(TimeoutError):
        await within(loop.create_future(), 0.01)
    assert await within(asyncio.sleep(0, "done"), None) == "done"
