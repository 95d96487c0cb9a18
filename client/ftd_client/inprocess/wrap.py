"""Wrapper: run a training function again, in the same process, after a fault in the job.

    @ftd_client.inprocess.Wrapper(soft_timeout=60, hard_timeout=90)
    def train(call_wrapper=None):
        torch.distributed.init_process_group("gloo")  # joins this round's world (env://)
        ...

Each call of the function is a *round*. Before it, the ranks meet at a barrier in the store,
learn who takes part, and the Wrapper sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT (a fresh store for every round) as torchrun would. When any rank faults — an
exception, a soft timeout, a dead process announced by the daemon — every rank's watcher
thread interrupts its function, runs the abort (which unblocks collectives that wait on dead
peers), and the rank goes to the next round's barrier.

Each call of the wrapped function is run by a Runner (runner.py); a function that declares a
`call_wrapper` parameter gets a CallWrapper (call_wrapper.py), importable from here too, as
from NVRx's `inprocess.wrap`.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar

from ftd_client.inprocess.abort import Abort, AbortTorchDistributed
from ftd_client.inprocess.call_wrapper import CallWrapper
from ftd_client.inprocess.compose import Compose
from ftd_client.inprocess.interrupt import DEFAULT_SIGNAL
from ftd_client.inprocess.rank_assignment import RankAssignmentCtx
from ftd_client.inprocess.runner import Runner
from ftd_client.inprocess.state import FrozenState

__all__ = ["CallWrapper", "Wrapper"]

log = logging.getLogger("ftd_client.inprocess")

P = ParamSpec("P")
R = TypeVar("R")
Seconds = float | timedelta
StateCallback = Callable[[FrozenState], object]
RankAssignmentFn = Callable[[RankAssignmentCtx], RankAssignmentCtx]

_calls = itertools.count()
"""Wrapped calls made by this process: each gets its own keys (all ranks count alike)."""


def _seconds(value: Seconds, name: str) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return seconds


class Wrapper:
    """Decorator that restarts the wrapped training function in-process after a fault.

    abort: what unblocks the rank (default AbortTorchDistributed()); Compose several.
    finalize: called with the state after the abort, before the next round's barrier.
    health_check: called after finalize; raising ends this rank (its process exits).
    soft_timeout: seconds (or timedelta) without progress before the rank is declared hung
        and the round restarted; progress is the function running Python code, or ping().
    hard_timeout: seconds from a fault for this rank's abort to finish; under the daemon also
        the time every rank has to reach the next barrier before the daemon kills the
        stragglers and restarts the processes.
    barrier_timeout: the longest wait for a round's members (without a daemon: after it, the
        ranks that arrived go on without the others).
    max_iterations: rounds at most (None: unlimited); then RestartError ends the process.
    interrupt_signal: the signal that wakes the main thread from a blocking call (None: the
        asynchronous exception alone).
    """

    def __init__(
        self,
        abort: Abort | Callable[[FrozenState], FrozenState] | None = None,
        finalize: StateCallback | None = None,
        health_check: StateCallback | None = None,
        soft_timeout: Seconds = 60.0,
        hard_timeout: Seconds = 90.0,
        barrier_timeout: Seconds = 120.0,
        progress_watchdog_interval: Seconds = 1.0,
        max_iterations: int | None = None,
        interrupt_signal: int | None = DEFAULT_SIGNAL,
        *,
        initialize: Callable[[FrozenState], FrozenState] | None = None,
        store_kwargs: dict[str, Any] | None = None,
        store_factory: object = None,
        enabled: bool = True,
        completion_timeout: Seconds = 120.0,
        rank_assignment: RankAssignmentFn | None = None,
        rank_filter: RankAssignmentFn | None = None,
        monitor_thread_interval: Seconds = 1.0,
        monitor_process_interval: Seconds = 1.0,
        heartbeat_interval: Seconds = 1.0,
        heartbeat_timeout: Seconds = 30.0,
        last_call_wait: Seconds = 1.0,
        termination_grace_time: Seconds = 5.0,
        monitor_process_logfile: str | None = None,
        completion: object = None,
        terminate: object = None,
    ) -> None:
        self.abort = abort if abort is not None else AbortTorchDistributed()
        self.finalize = finalize
        self.health_check = health_check
        self.soft_timeout_s = _seconds(soft_timeout, "soft_timeout")
        self.hard_timeout_s = _seconds(hard_timeout, "hard_timeout")
        self.barrier_timeout_s = _seconds(barrier_timeout, "barrier_timeout")
        self.progress_interval_s = _seconds(
            progress_watchdog_interval, "progress_watchdog_interval"
        )
        if self.hard_timeout_s < self.soft_timeout_s:
            raise ValueError("hard_timeout must not be shorter than soft_timeout")
        if max_iterations is not None and max_iterations < 1:
            raise ValueError(f"max_iterations must be at least 1, got {max_iterations}")
        self.max_iterations = max_iterations
        self.interrupt_signal = interrupt_signal
        self.initialize = initialize
        self.enabled = enabled
        if store_kwargs is not None and not isinstance(store_kwargs, dict):
            raise TypeError(f"store_kwargs must be a dict, got {type(store_kwargs).__name__}")
        # NVRx's Wrapper hosts its own TCPStore (store_factory, store_kwargs); here the rounds
        # meet in the store of ftd's daemon (or torchrun's): both are accepted, and unused.
        self.store_kwargs = dict(store_kwargs or {})
        self.store_factory = store_factory
        self.completion_timeout_s = _seconds(completion_timeout, "completion_timeout")
        # NVRx applies the filter after the assignment; None keeps ftd's own (ShiftRanks).
        steps = [step for step in (rank_filter, rank_assignment) if step is not None]
        self.rank_assignment: RankAssignmentFn | None = Compose(*steps) if steps else None
        # NVRx's monitor process, heartbeats, rank assignment and termination are the
        # daemon's work under `ftd serve` (docs/nvrx-compat.md): accepted, checked, unused.
        for name, value in (
            ("monitor_thread_interval", monitor_thread_interval),
            ("monitor_process_interval", monitor_process_interval),
            ("heartbeat_interval", heartbeat_interval),
            ("heartbeat_timeout", heartbeat_timeout),
            ("last_call_wait", last_call_wait),
            ("termination_grace_time", termination_grace_time),
        ):
            _seconds(value, name)
        self.unused = {
            name: value
            for name, value in (
                ("monitor_process_logfile", monitor_process_logfile),
                ("completion", completion),
                ("terminate", terminate),
            )
            if value is not None
        }

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]:
        if not self.enabled:
            return fn
        wants_call_wrapper = "call_wrapper" in inspect.signature(fn).parameters
        if self.unused:
            log.info("ftd: Wrapper arguments not used under ftd: %s", sorted(self.unused))

        @functools.wraps(fn)
        def wrapped(*args: P.args, **kwargs: P.kwargs) -> R:
            runner = Runner(self, next(_calls))
            try:
                result: R = runner.run(fn, args, kwargs, wants_call_wrapper)
                return result
            finally:
                runner.close()

        return wrapped
