"""NVRx's in-process API surface in ftd_client.inprocess: health checks, finalize, initialize,
the Wrapper's NVRx arguments and CallWrapper.atomic (the rounds themselves run in
tests/client/inprocess/test_inprocess.py and tests/client/inprocess/test_inprocess_ddp.py)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from ftd_client import inprocess
from ftd_client.inprocess import CallWrapper, FrozenState
from ftd_client.inprocess.keys import Fault

from tests.support.inprocess import run_ranks


def state(rank: int = 0, world: int = 4, iteration: int = 0, fault_rank: int | None = None) -> Any:
    fault = None
    if fault_rank is not None:
        fault = Fault.now("exception", fault_rank, "boom", iteration, f"rank {fault_rank}")
    return FrozenState(rank, world, rank, world, iteration, fault=fault)


def test_cuda_health_check_is_a_no_op_without_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the check synchronises with it (see docs/nvrx-compat.md)")
    s = state()
    assert inprocess.health_check.CudaHealthCheck(timedelta(seconds=1))(s) is s


def test_fault_counter_counts_this_ranks_faults_only() -> None:
    counter = inprocess.health_check.FaultCounter(max_rank_faults=1)
    counter(state(rank=0, fault_rank=2))  # a peer's fault
    counter(state(rank=0, fault_rank=0))
    assert counter.faults_count == 1
    with pytest.raises(inprocess.FaultCounterExceeded, match="faults_count=2"):
        counter(state(rank=0, fault_rank=0))


def test_retry_controller_aborts_the_wrapper() -> None:
    controller = inprocess.RetryController(max_iterations=3, min_world_size=2)
    controller(state(iteration=2))
    with pytest.raises(inprocess.RestartAbort):
        controller(state(iteration=3))
    with pytest.raises(inprocess.RestartAbort):
        controller(state(world=1))
    assert issubclass(inprocess.RestartAbort, BaseException)
    assert not issubclass(inprocess.RestartAbort, Exception)


def test_threaded_finalize_runs_times_out_and_reraises() -> None:
    ran = threading.Event()
    inprocess.ThreadedFinalize(timedelta(seconds=5), ran.set)(state())
    assert ran.is_set()
    release = threading.Event()
    stuck = inprocess.ThreadedFinalize(timedelta(milliseconds=50), release.wait)
    with pytest.raises(inprocess.exceptions.TimeoutError):
        stuck(state())
    release.set()

    def fail() -> None:
        raise ValueError("finalize failed")

    with pytest.raises(ValueError, match="finalize failed"):
        inprocess.ThreadedFinalize(timedelta(seconds=5), fail)(state())


def test_wrapper_takes_nvrx_arguments() -> None:
    wrapper = inprocess.Wrapper(
        store_kwargs={"port": 29501},
        health_check=inprocess.health_check.CudaHealthCheck(),
        initialize=inprocess.RetryController(max_iterations=5),
        heartbeat_timeout=timedelta(seconds=30),
        completion_timeout=timedelta(seconds=120),
        last_call_wait=timedelta(seconds=1),
        termination_grace_time=timedelta(seconds=5),
        monitor_process_logfile="/tmp/ignored.log",
    )
    assert wrapper.store_kwargs == {"port": 29501}
    assert wrapper.unused == {"monitor_process_logfile": "/tmp/ignored.log"}
    with pytest.raises(TypeError, match="store_kwargs must be a dict"):
        inprocess.Wrapper(store_kwargs=[("port", 1)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="heartbeat_timeout must be positive"):
        inprocess.Wrapper(heartbeat_timeout=timedelta(0))

    def train() -> int:
        return 7

    assert inprocess.Wrapper(enabled=False)(train) is train


def test_atomic_holds_the_restart_off_and_waits_for_one_in_progress() -> None:
    runner = SimpleNamespace(atomic_lock=threading.RLock())
    call_wrapper = CallWrapper(runner)  # type: ignore[arg-type]
    order: list[str] = []
    inside, watcher_done = threading.Event(), threading.Event()

    def watcher() -> None:  # what _on_fault does: interrupt and abort under the lock
        inside.wait()
        with runner.atomic_lock:
            order.append("abort")
        watcher_done.set()

    thread = threading.Thread(target=watcher)
    thread.start()
    with call_wrapper.atomic():
        inside.set()
        time.sleep(0.05)  # the watcher is waiting for this block, not interrupting it
        order.append("checkpoint written")
    watcher_done.wait(5)
    thread.join(5)
    assert order == ["checkpoint written", "abort"]
    with call_wrapper.atomic(), call_wrapper.atomic():  # reentrant, like NVRx's
        pass


# -- rank assignment -------------------------------------------------------------------------

ra = inprocess.rank_assignment


def assigned(assignment: Any, world: int, gone: set[int], store: Any = None) -> dict[int, Any]:
    """Each surviving initial rank's resulting state."""
    members = [r for r in range(world) if r not in gone]
    results = {}
    for slot in members:
        s = FrozenState(slot, world, slot, world, 1, active_rank=slot, active_world_size=world)
        results[slot] = ra.assign(assignment, s, members, store)
    return results


def test_shift_ranks_and_fill_gaps_as_nvrx_draws_them() -> None:
    shifted = assigned(ra.ShiftRanks(), 8, {1, 4, 5})
    assert [shifted[s].rank for s in (0, 2, 3, 6, 7)] == [0, 1, 2, 3, 4]
    filled = assigned(ra.FillGaps(), 8, {1, 4, 5})
    assert [filled[s].rank for s in (0, 6, 2, 3, 7)] == [0, 1, 2, 3, 4]
    assert {s.world_size for s in filled.values()} == {5}
    assert all(s.mode is inprocess.Mode.ACTIVE for s in filled.values())


def test_filters_make_reserves() -> None:
    states = assigned(inprocess.Compose(ra.MaxActiveWorldSize(4), ra.ShiftRanks()), 6, {0})
    active = {slot: s.active_rank for slot, s in states.items() if s.mode is inprocess.Mode.ACTIVE}
    assert active == {1: 0, 2: 1, 3: 2, 4: 3}
    assert states[5].mode is inprocess.Mode.INACTIVE and states[5].active_rank is None
    divisible = assigned(
        inprocess.Compose(ra.ActiveWorldSizeDivisibleBy(2), ra.ShiftRanks()), 4, {3}
    )
    assert {s.active_world_size for s in divisible.values()} == {2}
    assert divisible[2].mode is inprocess.Mode.INACTIVE


def test_a_terminated_rank_is_discarded() -> None:
    state = FrozenState(1, 4, 1, 4, 1)
    with pytest.raises(ra.RankDiscarded):
        ra.assign(ra.ShiftRanks(), state, [0, 2, 3], None)  # slot 1 is not a member
    with pytest.raises(ra.RankDiscarded):  # terminated by a filter, discarded by no one else
        ra.assign(lambda ctx: ra.RankAssignmentCtx(ctx.state, None, {1}), state, [0, 1, 2, 3], None)


def test_filter_count_grouped_by_key_counts_through_a_real_store() -> None:
    """Two hosts of 2 ranks; host b lost one: both of b's ranks are dropped, a's shifted."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    members = [0, 1, 2]  # slot 3 (host b) is gone
    assignment = inprocess.Compose(
        ra.ShiftRanks(),
        ra.FilterCountGroupedByKey(lambda s: hosts[s.rank], lambda count: count == 2),
    )
    results: dict[int, Any] = run_ranks(dict.fromkeys(members, assignment), 4, members, server.port)
    assert isinstance(results[2], ra.RankDiscarded)
    assert (results[0].rank, results[1].rank, results[0].world_size) == (0, 1, 2)


def test_nvrx_exception_module_name_gives_the_same_classes() -> None:
    """NVRx code says `inprocess.exception.RestartError`; after the import swap that is ftd's."""
    assert inprocess.exception.RestartError is inprocess.RestartError
    assert inprocess.exception.HealthCheckError is inprocess.HealthCheckError
    assert issubclass(inprocess.exception.TimeoutError, inprocess.RestartError)
    with pytest.raises(inprocess.exception.RestartError):
        raise inprocess.FaultCounterExceeded("over the limit")
