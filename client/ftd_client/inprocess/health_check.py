"""Health checks: run after the abort and `finalize`, before a rank joins the next round.

Raising keeps the rank out (the Wrapper re-raises: its process exits and its launcher acts).
Several compose with `Compose`, like aborts. Names and behaviour follow NVRx's
`inprocess.health_check`.
"""

from __future__ import annotations

import abc
import os
from datetime import timedelta

from ftd_client.inprocess.exceptions import FaultCounterExceeded
from ftd_client.inprocess.finalize import run_bounded
from ftd_client.inprocess.state import FrozenState


class HealthCheck(abc.ABC):
    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        """Raise if this rank must not go on; else return `state` (or a copy)."""


class CudaHealthCheck(HealthCheck):
    """Synchronises with this rank's GPU (the device of LOCAL_RANK, else the current one),
    within `timeout`, then once more: a failed kernel or a corrupted context raises.

    Where CUDA is not available, or this process never initialised it (a CPU job), there is
    nothing to check: the state is returned at once, as NVRx's own check does.
    """

    def __init__(self, timeout: timedelta = timedelta(seconds=30)) -> None:
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"CudaHealthCheck(timeout={self.timeout!r})"

    def __call__(self, state: FrozenState) -> FrozenState:
        import torch

        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return state
        local_rank = os.environ.get("LOCAL_RANK")
        device = torch.device("cuda", int(local_rank) if local_rank else None)
        # A wedged kernel never returns: the first synchronisation runs in a thread.
        run_bounded(
            lambda: torch.cuda.synchronize(device),
            self.timeout,
            "ftd-cuda-health",
            f"torch.cuda.synchronize({device})",
        )
        torch.cuda.synchronize(device)  # the context is still usable after the wait
        return state


class FaultCounter(HealthCheck):
    """Counts the faults this rank caused (its exceptions and soft timeouts); more than
    `max_rank_faults` (None: no limit) raises FaultCounterExceeded, ending its process."""

    def __init__(self, max_rank_faults: int | None = None) -> None:
        self.max_rank_faults = max_rank_faults
        self.faults_count = 0

    def __repr__(self) -> str:
        return f"FaultCounter(max_rank_faults={self.max_rank_faults})"

    def __call__(self, state: FrozenState) -> FrozenState:
        if state.fault is None or state.fault.rank != state.initial_rank:
            return state
        self.faults_count += 1
        if self.max_rank_faults is not None and self.faults_count > self.max_rank_faults:
            raise FaultCounterExceeded(
                f"faults_count={self.faults_count} / max_rank_faults={self.max_rank_faults}"
            )
        return state
