"""CallWrapper: what a wrapped function that declares a `call_wrapper` parameter is given."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

from ftd_client.inprocess.monitor import Watchdog
from ftd_client.inprocess.state import FrozenState


class Lock(Protocol):
    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...
    def release(self) -> None: ...


class Runner(Protocol):
    """What a CallWrapper reaches of its call's runner (runner.py)."""

    @property
    def state(self) -> FrozenState: ...
    @property
    def watchdog(self) -> Watchdog: ...
    @property
    def atomic_lock(self) -> Lock: ...

    def report_fault(self, reason: str) -> None: ...


ATOMIC_POLL_S = 0.01


class CallWrapper:
    """Given to a function that declares a `call_wrapper` parameter."""

    def __init__(self, runner: Runner) -> None:
        self._runner = runner

    @property
    def iteration(self) -> int:
        """The round: 0 on the first call, +1 after each in-process restart."""
        return self._runner.state.iteration

    @property
    def state(self) -> FrozenState:
        return self._runner.state

    def ping(self) -> None:
        """Report progress: resets the soft timeout."""
        self._runner.watchdog.ping()

    @contextlib.contextmanager
    def disable_hang_protection(self) -> Iterator[None]:
        """A block that may stall without a soft timeout (a long data load, a checkpoint
        read): NVRx's context manager. The stall is measured again from the block's end. A
        fault elsewhere still ends the round, and the daemon's hard timeout still applies to
        a rank that cannot arrive then."""
        self._disable_hang_protection()
        try:
            yield
        finally:
            self._enable_hang_protection()

    def _disable_hang_protection(self) -> None:
        """NVRx's partner methods, for a block across functions: each disable needs its
        enable."""
        self._runner.watchdog.suspend()

    def _enable_hang_protection(self) -> None:
        self._runner.watchdog.resume()

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """A block the restart never interrupts: the watcher waits for it to end before it
        interrupts the function and runs the abort, and once the restart has begun the block
        does not start (an interrupt arrives while waiting to enter). A block that hangs on
        a dead peer therefore holds the restart up until the daemon's hard timeout."""
        lock = self._runner.atomic_lock
        while not lock.acquire(timeout=ATOMIC_POLL_S):  # interruptible between tries
            pass
        try:
            yield
        finally:
            lock.release()

    def report_fault(self, reason: str) -> None:
        """End this round on every rank without raising here: the fault is announced (to the
        daemon and every peer) and this function is interrupted like the others'. For errors
        that training code swallowed, e.g. a ManagedProcessGroup's (see RoundManager)."""
        self._runner.report_fault(reason)
