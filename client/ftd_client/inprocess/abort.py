"""Aborts: what unblocks a rank whose peers failed, run by the Wrapper's watcher thread.

An abort runs while the training function's thread may still be blocked in a collective. On
NCCL, aborting the communicators releases it. On gloo (CPU) a rank's collective is released when
a *peer* closes its side (destroys its group, or dies), never by the rank's own threads: so
every rank destroys its groups, and a faulting rank's abort is what frees the others (measured
on torch 2.13; docs/inprocess.md). torch is imported here only when an abort runs.
"""

from __future__ import annotations

import abc
import logging
import os
import threading
import time
from typing import Any

from ftd_client.inprocess.state import FrozenState

log = logging.getLogger("ftd_client.inprocess")

FLIGHT_RECORDER_VARIABLES = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE")

_retired: list[Any] = []
_retired_lock = threading.Lock()


def retire(groups: list[Any]) -> None:
    """Keep a Python reference to each destroyed group until `release_retired` drops it.

    The last reference to a process group must not be dropped while the GIL is held: a gloo
    group's destructor joins its worker threads, and a worker finishing a collective that was
    in flight (released by a peer's abort) destroys its work item, which takes the GIL. When
    the training function's frames are cleared, DDP's Reducer (whose destructor keeps the GIL)
    would be that last owner. The group's own Python object is not: torch releases the GIL
    while destroying it. So the groups stay referenced here past the frames' release.
    """
    with _retired_lock:
        _retired.extend(groups)


def release_retired(timeout_s: float) -> bool:
    """Drop the retired groups in a helper thread (each destructor releases the GIL while it
    joins the group's threads); whether they were gone within `timeout_s`. A group whose
    threads never finish stays behind with its thread, and the rank goes on."""
    with _retired_lock:
        groups = _retired[:]
        _retired.clear()
    if not groups:
        return True
    thread = threading.Thread(target=_drop, args=(groups,), name="ftd-release-groups", daemon=True)
    del groups
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        log.warning("ftd: destroyed process groups still releasing after %.1fs", timeout_s)
        return False
    return True


def _drop(groups: list[Any]) -> None:
    groups.clear()


class Abort(abc.ABC):
    """One step of the termination mechanism: called with the Wrapper's read-only state from
    the watcher thread once a fault is known; returns the state to forward (see Compose)."""

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        """Unblock what waits on dead or unresponsive peers; return `state` (or a copy)."""


class AbortTorchDistributed(Abort):
    """Abort pending collectives and destroy every torch.distributed process group.

    Each group is aborted and destroyed in its own thread, the default group last, so one
    stuck group cannot hold up the others; a destroy still running after `timeout_s` is left
    behind with a warning. With `torch_fr_trace_path` and a Flight Recorder buffer
    (TORCH_NCCL_TRACE_BUFFER_SIZE or TORCH_FR_BUFFER_SIZE set to a positive size), the traces
    are first written to `<path>/rank_<initial rank>_iteration_<n>.pkl`; the directory is
    created. Stack traces are left out: collecting them needs the GIL, which the blocked
    thread may hold.
    """

    def __init__(
        self, torch_fr_trace_path: str | os.PathLike[str] | None = None, timeout_s: float = 30.0
    ) -> None:
        self.torch_fr_trace_path = (
            os.fspath(torch_fr_trace_path) if torch_fr_trace_path is not None else None
        )
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"AbortTorchDistributed(torch_fr_trace_path={self.torch_fr_trace_path!r})"

    def __call__(self, state: FrozenState) -> FrozenState:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return state
        if self.torch_fr_trace_path is not None and flight_recorder_enabled():
            try:
                path = dump_flight_recorder(self.torch_fr_trace_path, state)
                log.info("ftd: Flight Recorder traces written to %s", path)
            except Exception as error:
                log.warning("ftd: could not collect the Flight Recorder traces: %s", error)
        from torch.distributed import distributed_c10d as c10d

        default = c10d._get_default_group()
        groups = [group for group in list(c10d._world.pg_map) if group is not default]
        retire([*groups, default])
        self._destroy_each(groups, dist.destroy_process_group)
        self._destroy_each([default], lambda group: dist.destroy_process_group())
        return state

    def _destroy_each(self, groups: list[Any], destroy: Any) -> None:
        threads = []
        for group in groups:
            thread = threading.Thread(
                target=_abort_and_destroy,
                args=(group, destroy),
                name="ftd-abort-group",
                daemon=True,
            )
            thread.start()
            threads.append(thread)
        deadline = time.monotonic() + self.timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = sum(thread.is_alive() for thread in threads)
        if stuck:
            log.warning(
                "ftd: %d process groups still destroying after %.1fs", stuck, self.timeout_s
            )


def _abort_and_destroy(group: Any, destroy: Any) -> None:
    try:
        abort = getattr(group, "abort", None)
        if abort is not None:
            abort()  # NCCL: aborts the communicators; gloo: returns at once
    except Exception as error:
        log.debug("ftd: abort of a process group failed: %s", error)
    try:
        destroy(group)
    except Exception as error:  # already gone, or the backend refused: nothing more to do
        log.debug("ftd: destroying a process group failed: %s", error)


def flight_recorder_enabled() -> bool:
    for name in FLIGHT_RECORDER_VARIABLES:
        try:
            if int(os.environ.get(name, "0") or "0") > 0:
                return True
        except ValueError:
            continue
    return False


def dump_flight_recorder(directory: str, state: FrozenState) -> str:
    """Write this rank's Flight Recorder traces (pickled, as torch dumps them) and return the
    file's path; NCCL's recorder where NCCL is built in, else the generic one (gloo)."""
    import torch._C._distributed_c10d as c10d

    dump = getattr(c10d, "_dump_nccl_trace", None) or getattr(c10d, "_dump_fr_trace")  # noqa: B009
    data = dump(includeCollectives=True, includeStackTraces=False, onlyActive=False)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"rank_{state.initial_rank}_iteration_{state.iteration}.pkl")
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as out:
        out.write(data)
    os.replace(tmp, path)
    return path


class AbortTransformerEngine(Abort):
    """Destroy Transformer Engine's userbuffers (tensor-parallel communication overlap).

    Needs `transformer_engine.pytorch`; constructing it without raises ImportError saying so.
    """

    def __init__(self) -> None:
        try:
            import transformer_engine.pytorch  # noqa: F401
        except (ImportError, OSError, RuntimeError) as error:  # absent, or no CUDA libraries
            raise ImportError(
                "AbortTransformerEngine needs Transformer Engine, and "
                f"`import transformer_engine.pytorch` failed here ({error}). Install "
                "transformer-engine[pytorch], or leave AbortTransformerEngine out of the "
                "Wrapper's abort (AbortTorchDistributed alone aborts torch.distributed)."
            ) from error

    def __repr__(self) -> str:
        return "AbortTransformerEngine()"

    def __call__(self, state: FrozenState) -> FrozenState:
        from transformer_engine.pytorch.module import base

        destroy_ub = getattr(base, "destroy_ub", None)
        if destroy_ub is not None:
            destroy_ub()
        return state
