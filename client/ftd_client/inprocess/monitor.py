"""The two threads beside the training function: the watcher (faults) and the watchdog
(progress, soft timeout). Each has its own store client: a blocked wait holds its connection.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ftd_client.inprocess.keys import STOP, Fault, Seal, valid_fault

log = logging.getLogger("ftd_client.inprocess")

_libc = ctypes.CDLL(None, use_errno=True)
_PENDING_CALL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_add_pending_call = ctypes.PYFUNCTYPE(ctypes.c_int, _PENDING_CALL, ctypes.c_void_p)(
    ("Py_AddPendingCall", ctypes.pythonapi)
)
_sem_post = ctypes.cast(_libc.sem_post, _PENDING_CALL)
"""The pending call itself: C code, so that no Python runs in the main thread on the
watchdog's behalf. An interrupt raised inside a Python callback would be swallowed there."""


class _ProgressSemaphore:
    """A POSIX semaphore that the main thread posts when it runs the pending call. Kept for the
    life of the process: a pending call may still run after its watchdog stopped."""

    def __init__(self) -> None:
        self._sem = ctypes.create_string_buffer(64)  # >= sizeof(sem_t) on Linux
        if _libc.sem_init(self._sem, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")

    @property
    def address(self) -> int:
        return ctypes.addressof(self._sem)

    def take(self) -> bool:
        """Whether it was posted since the last take (non-blocking)."""
        return bool(_libc.sem_trywait(self._sem) == 0)


_progress = _ProgressSemaphore()


class Watcher(threading.Thread):
    """Waits for each round's fault (its wake key); hands it to `on_fault` (which interrupts
    the function and runs the abort). Rounds to watch arrive through `watch()`."""

    def __init__(
        self,
        store: Any,
        wake_key: Callable[[int], str],
        fault_key: Callable[[int], str],
        on_fault: Callable[[int, Fault], None],
        seal: Seal | None = None,
    ) -> None:
        super().__init__(name="ftd-inprocess-watcher", daemon=True)
        self._seal = seal or Seal()
        self._store = store
        self._wake = wake_key
        self._fault = fault_key
        self._on_fault = on_fault
        self._rounds: queue.SimpleQueue[int | None] = queue.SimpleQueue()

    def watch(self, rnd: int) -> None:
        self._rounds.put(rnd)

    def stop(self) -> None:
        self._rounds.put(None)

    def run(self) -> None:
        while (rnd := self._rounds.get()) is not None:
            try:
                fault: Fault | None = None
                while fault is None:  # a forged fault wakes it, and it waits again
                    if self._store.get(self._wake(rnd)) == STOP:
                        break
                    fault = valid_fault(self._store, self._seal, self._fault(rnd), self._wake(rnd))
            except Exception as error:  # the store is gone: nothing more to watch
                log.warning("ftd: the in-process watcher lost the store: %s", error)
                return
            if fault is not None:
                self._on_fault(rnd, fault)


class Watchdog(threading.Thread):
    """Measures the function's progress and declares a soft timeout when it stops.

    Progress is an explicit `ping()`, or the function's thread running Python code: every
    interval the watchdog schedules a pending call (Py_AddPendingCall: sem_post on a
    semaphore), which the main thread runs at its next bytecode boundary. A main thread
    asleep, blocked in a collective or busy in C code runs none, so its progress stalls.
    Pending calls run on the main thread only: elsewhere only `ping()` counts.
    """

    def __init__(
        self,
        soft_timeout_s: float,
        interval_s: float,
        on_timeout: Callable[[int, float], None],
        automatic: bool,
    ) -> None:
        super().__init__(name="ftd-inprocess-watchdog", daemon=True)
        self.soft_timeout_s = soft_timeout_s
        self.interval_s = interval_s
        self._on_timeout = on_timeout
        self._automatic = automatic
        self._cond = threading.Condition()
        self._round: int | None = None
        self._stopped = False
        self.last_progress = time.monotonic()
        self._pending = False
        self._suspended = 0
        """Blocks of `CallWrapper.disable_hang_protection` the function is in (nested)."""

    def ping(self) -> None:
        self.last_progress = time.monotonic()

    def suspend(self) -> None:
        """No soft timeout until as many `resume` calls: a block the function knows is long."""
        with self._cond:
            self._suspended += 1

    def resume(self) -> None:
        """The stall is measured again from now (never from before the block)."""
        with self._cond:
            self._suspended = max(0, self._suspended - 1)
            self.last_progress = time.monotonic()
            self._cond.notify_all()

    def arm(self, rnd: int) -> None:
        with self._cond:
            self._round = rnd
            self.last_progress = time.monotonic()
            self._cond.notify_all()

    def disarm(self) -> None:
        with self._cond:
            self._round = None
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._round = None
            self._cond.notify_all()

    def run(self) -> None:
        while True:
            with self._cond:
                while (self._round is None or self._suspended) and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                rnd = self._round
                if self._automatic:
                    if self._pending and _progress.take():
                        self._pending = False
                        self.last_progress = time.monotonic()
                    if not self._pending:
                        self._pending = _add_pending_call(_sem_post, _progress.address) == 0
                stalled = time.monotonic() - self.last_progress
                if stalled >= self.soft_timeout_s:
                    self._round = None
                else:
                    deadline = self.soft_timeout_s - stalled
                    self._cond.wait(min(self.interval_s, deadline))
                    continue
            assert rnd is not None
            self._on_timeout(rnd, stalled)
