"""Bounded calls (ftd.tasks.within): a cancel is never lost to a call's completion, an error
never to a cancel; the daemon's teardown (ftd.tasks.Teardown)."""

from __future__ import annotations

import asyncio
import contextlib
import gc

import pytest

from ftd.tasks import Teardown, within


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


async def test_a_failed_call_cut_by_a_cancel_leaves_no_unretrieved_error() -> None:
    """Python 3.11's wait_for ran the call in a task of its own: cancelled as that task failed
    (a replica push's broken pipe at teardown), its error was never retrieved and asyncio
    logged it. `within` runs the call in the caller's task: the error is the caller's."""
    loop = asyncio.get_running_loop()
    unretrieved: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))
    failing = asyncio.Event()

    async def push() -> None:
        failing.set()
        try:
            await asyncio.sleep(60)
        finally:
            raise BrokenPipeError  # its connection's end fails as it is cut

    async def loop_body() -> None:
        with contextlib.suppress(BrokenPipeError):
            await within(push(), 30)

    task = asyncio.create_task(loop_body())
    await failing.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    del task  # its error's context holds the call's frames
    gc.collect()
    await asyncio.sleep(0)
    loop.set_exception_handler(None)
    assert unretrieved == []


async def test_teardown_runs_every_step_in_reverse_after_the_first_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    done: list[str] = []
    teardown = Teardown(timeout_s=0.2)

    async def step(name: str) -> None:
        done.append(name)

    async def failing() -> None:
        raise OSError("a full disk")

    teardown.push("the first part", lambda: step("first up"))
    teardown.push_now("the last word", lambda: done.append("said"), first=True)
    teardown.push("a failing part", failing)
    teardown.push("a stuck part", lambda: asyncio.sleep(60))
    teardown.push("the last part", lambda: step("last up"))
    await teardown.run()
    assert done == ["said", "last up", "first up"]
    assert "error while a failing part" in caplog.text
    assert "teardown gave up a stuck part after 0 s; threads:" in caplog.text
    await teardown.run()  # nothing twice
    assert done == ["said", "last up", "first up"]
