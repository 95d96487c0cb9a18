"""The one owner of the daemon's background work.

Every task that nobody awaits (a status update sent to the store, an exclusion, the wait for a
restart's first step) is started here: its error is logged with its name, never lost and never
raised into the loop, and every task is cancelled and awaited when the daemon closes.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger("ftd.tasks")
T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout_s: float | None) -> T:
    """`asyncio.wait_for` without its Python 3.11 flaw: there, a cancellation that lands while
    the awaited call completes is dropped, and the cancelled task goes on as if nothing
    happened (a round's closer, cancelled as the round closed, slept out the join timeout and
    held its node for ten minutes). `asyncio.timeout` keeps the cancellation. TimeoutError
    when `timeout_s` passes; None waits as long as it takes."""
    async with asyncio.timeout(timeout_s):
        return await awaitable


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any] | None:
        if self._closed:
            coro.close()
            return None
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def adopt(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """A task its caller awaits or drops: owned here, so that closing cancels and awaits
        it; its error is the caller's to read, never logged here (once closed: cancelled)."""
        task = asyncio.create_task(coro, name=name)
        if self._closed:
            task.cancel()
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda done: done.cancelled() or done.exception())
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            log.error("background task %s failed: %r", task.get_name(), error, exc_info=error)

    def cancel(self) -> None:
        """Cancel every task now and start no more (a synchronous teardown's `close`)."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()

    async def close(self) -> None:
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def first_of(*awaitables: Awaitable[Any]) -> asyncio.Future[Any]:
    """The first of `awaitables` to finish; coroutines left unfinished are cancelled, futures
    passed in are left to their owners."""
    futures = [asyncio.ensure_future(a) for a in awaitables]
    done, _ = await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
    for given, future in zip(awaitables, futures, strict=True):
        if future not in done and not isinstance(given, asyncio.Future):
            future.cancel()
    return next(f for f in futures if f in done)


class Teardown:
    """What the parts registered as they came up, undone in reverse when the daemon leaves (an
    AsyncExitStack whose every step is named and bounded): every step runs, an error is
    reported with the step's name, a step past `timeout_s` is logged with every thread's
    stack and left behind."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._steps: list[tuple[str, Callable[[], Awaitable[object]]]] = []
        self._first: list[tuple[str, Callable[[], Awaitable[object]]]] = []

    def push(self, what: str, step: Callable[[], Awaitable[object]]) -> None:
        self._steps.append((what, step))

    def push_now(self, what: str, step: Callable[[], object], first: bool = False) -> None:
        """A step that must run on the loop's thread (it unregisters readers, say); `first`:
        before every other step, while every part is still up (the last word to the event
        stream's readers, say)."""

        async def now() -> None:
            step()

        (self._first if first else self._steps).append((what, now))

    async def run(self) -> None:
        steps, self._steps = [*self._first, *reversed(self._steps)], []
        self._first = []
        for what, step in steps:
            try:
                await within(step(), self.timeout_s)
            except TimeoutError:
                log.error(
                    "teardown gave up %s after %.0f s; threads:\n%s",
                    what,
                    self.timeout_s,
                    _thread_stacks(),
                )
            except Exception:
                log.exception("error while %s", what)


def _thread_stacks() -> str:
    """Every thread's stack, for a log line that says where teardown is stuck."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(
        f"--- {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
        for ident, frame in frames.items()
    )
