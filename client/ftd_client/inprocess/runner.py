"""One wrapped call (a Runner): its rounds on the main thread, its watcher and watchdog threads,
and the signal handler it restores.

The main thread joins each round at the barrier, sets the round's environment, calls the
function and, after a fault, waits for the abort, frees what the failed call's frames hold
and goes to the next round's barrier. The watcher thread takes on a round's fault (it
interrupts the function, then runs the abort); the watchdog announces a soft timeout.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from ftd_client.inprocess.abort import release_retired
from ftd_client.inprocess.call_wrapper import CallWrapper
from ftd_client.inprocess.coordination import IDLE_WAIT, Coordination, endpoint_from_env
from ftd_client.inprocess.exceptions import RestartAbort, RestartError, RestartInterrupt
from ftd_client.inprocess.interrupt import Interrupter
from ftd_client.inprocess.keys import Fault, Members
from ftd_client.inprocess.monitor import Watchdog, Watcher
from ftd_client.inprocess.rank_assignment import RankAssignmentCtx, assign
from ftd_client.inprocess.state import FrozenState, Mode

log = logging.getLogger("ftd_client.inprocess")

CLOSE_JOIN_TIMEOUT_S = 10.0


def release_frames(error: BaseException, groups_timeout_s: float = CLOSE_JOIN_TIMEOUT_S) -> None:
    """Free what the failed call's frames hold, process groups included.

    A process group destroyed while a collective was in flight lives on as long as the frames
    of that collective do, and they live in the exception's traceback: its connections stay
    open, and a peer blocked on them is never released (gloo). So the traceback goes, and a
    collection frees what cycles hold (DDP's Reducer among them). The groups the abort
    destroyed are released last, with the GIL free while their threads finish (see
    abort.retire): under DDP, the Reducer's destructor would otherwise join a gloo worker that
    waits for the GIL the destructor holds.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if current.__traceback__ is not None:
            traceback.clear_frames(current.__traceback__)
            current.__traceback__ = None
        current = current.__cause__ or current.__context__
    gc.collect()
    release_retired(groups_timeout_s)


GROUP_CAPTURING_MODULES = (
    "torch.distributed.nn.functional",
    "torch.distributed.optim.zero_redundancy_optimizer",
    "torch.distributed.fsdp.sharded_grad_scaler",
)
"""torch modules whose functions take `group.WORLD` as a default argument, evaluated when the
module is imported: imported during a round (DDP imports the first one lazily), they would keep
that round's default group, and its sockets, alive for the life of the process, so a peer
blocked on it is never released (torch 2.13). Imported before the first round, they keep None."""


def import_group_capturing_modules() -> None:
    import importlib

    for name in GROUP_CAPTURING_MODULES:
        try:
            importlib.import_module(name)
        except Exception as error:  # a torch without it: nothing to pin either
            log.debug("ftd: could not import %s: %s", name, error)


class Settings(Protocol):
    """What a Runner reads of its Wrapper (wrap.py)."""

    @property
    def abort(self) -> Callable[[FrozenState], FrozenState]: ...
    @property
    def finalize(self) -> Callable[[FrozenState], object] | None: ...
    @property
    def health_check(self) -> Callable[[FrozenState], object] | None: ...
    @property
    def initialize(self) -> Callable[[FrozenState], FrozenState] | None: ...
    @property
    def rank_assignment(self) -> Callable[[RankAssignmentCtx], RankAssignmentCtx] | None: ...
    @property
    def soft_timeout_s(self) -> float: ...
    @property
    def hard_timeout_s(self) -> float: ...
    @property
    def barrier_timeout_s(self) -> float: ...
    @property
    def progress_interval_s(self) -> float: ...
    @property
    def max_iterations(self) -> int | None: ...
    @property
    def interrupt_signal(self) -> int | None: ...


class Runner:
    """One wrapped call: the rounds, the threads, the restored signal handler."""

    def __init__(self, wrapper: Settings, call: int) -> None:
        self.wrapper = wrapper
        env = os.environ
        self.slot = int(env.get("RANK", "0"))
        self.initial_world_size = int(env.get("WORLD_SIZE", "1"))
        self.local_rank = env.get("LOCAL_RANK")
        self.coordination = Coordination(
            endpoint_from_env(call),
            self.slot,
            self.initial_world_size,
            wrapper.barrier_timeout_s,
            wrapper.hard_timeout_s,
        )
        self.state = FrozenState(self.slot, self.initial_world_size, self.slot, 0, 0)
        self.members: Members | None = None
        self._lock = threading.Lock()
        self.atomic_lock = threading.RLock()
        """Held by CallWrapper.atomic() and by the watcher while it interrupts and aborts."""
        self._finished: set[int] = set()
        """Rounds whose call returned: a late fault must not abort what the caller goes on with."""
        self._handling: set[int] = set()
        """Rounds whose fault the watcher took on (interrupt, abort) before the call returned."""
        self._aborted: dict[int, threading.Event] = {}
        self.interrupter = Interrupter(wrapper.interrupt_signal)
        self.interrupter.install()
        keys = self.coordination.keys
        self.watcher = Watcher(
            self.coordination.client(IDLE_WAIT.total_seconds()),
            lambda rnd: keys.wake(rnd, self.slot),
            keys.fault,
            self._on_fault,
            self.coordination.seal,
        )
        self._watchdog_store: Any = None
        self._assignment_store: Any = None
        on_main = threading.current_thread() is threading.main_thread()
        self.watchdog = Watchdog(
            wrapper.soft_timeout_s, wrapper.progress_interval_s, self._on_soft_timeout, on_main
        )
        self.watcher.start()
        self.watchdog.start()

    # -- the main thread -----------------------------------------------------------------

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        wants_call_wrapper: bool,
    ) -> Any:
        import_group_capturing_modules()
        if gc.get_freeze_count() == 0:
            # What exists before the first round (torch's modules, the model) lives for the
            # whole process; frozen, release_frames' collection skips it (~200 ms less per
            # restart at 4 ranks on 2 cores). Ranks forked by ftd's zygote come frozen.
            gc.freeze()
        rnd = self.coordination.first_round()
        while True:
            members = self.coordination.join(rnd, self.members)
            self._enter(rnd, members)
            if wants_call_wrapper:
                kwargs = {**kwargs, "call_wrapper": CallWrapper(self)}
            ok, value = self._call_active(fn, args, kwargs)
            if ok and self._finish(rnd):
                return value
            error: BaseException = (
                value if not ok else RestartInterrupt(f"round {rnd} had a fault before it returned")
            )
            value = None  # what a failed round returned holds nothing the next one may use
            if isinstance(error, (KeyboardInterrupt, SystemExit, RestartAbort)):
                if self._stop(rnd):  # the watcher must leave its wait before the process exits
                    self.coordination.stop_watcher(rnd, self.slot)
                raise error
            self._recover(rnd, error)
            rnd += 1

    def _enter(self, rnd: int, members: Members) -> None:
        rank = members.rank_of(self.slot)
        assert rank is not None
        self.members = members
        env = os.environ
        env["RANK"] = str(rank)
        env["WORLD_SIZE"] = str(len(members.slots))
        env["LOCAL_RANK"] = self.local_rank if self.local_rank is not None else str(rank)
        env["MASTER_ADDR"] = members.master_addr
        env["MASTER_PORT"] = str(members.master_port)
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # the round's store is hosted already
        self.state = FrozenState(
            self.slot,
            self.initial_world_size,
            rank,
            len(members.slots),
            rnd,
            active_rank=rank,
            active_world_size=len(members.slots),
        )
        if self.wrapper.rank_assignment is not None:
            if self._assignment_store is None:
                self._assignment_store = self.coordination.assignment_store(
                    self.wrapper.barrier_timeout_s
                )
            self.state = assign(
                self.wrapper.rank_assignment,
                self.state,
                list(members.slots),
                self._assignment_store,
            )
            if self.state.active_rank is not None:
                env["RANK"] = str(self.state.active_rank)
                env["WORLD_SIZE"] = str(self.state.active_world_size)
        self._aborted[rnd] = threading.Event()
        self.watcher.watch(rnd)
        self.watchdog.arm(rnd)
        log.info(
            "ftd: round %d: rank %d of %d (initial rank %d)",
            rnd,
            rank,
            len(members.slots),
            self.slot,
        )

    def _call_active(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[bool, Any]:
        """`_call` on an active rank. A reserve (inactive) waits for the round's end as if it
        had returned, and joins the next round if a fault ends this one first."""
        if self.state.mode is Mode.INACTIVE:
            self.watchdog.disarm()
            return True, None
        return self._call(fn, args, kwargs)

    def _call(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[bool, Any]:
        """Run the function with interruption armed; (True, result) or (False, exception).
        An interrupt that arrives while disarming is caught here too."""
        try:
            try:
                self.interrupter.arm()
                if self.wrapper.initialize is not None:
                    self.state = self.wrapper.initialize(self.state)
                return True, fn(*args, **kwargs)
            except BaseException as error:
                return False, error
            finally:
                self.interrupter.disarm()
                self.watchdog.disarm()
        except RestartInterrupt as late:
            self.interrupter.disarm()
            self.watchdog.disarm()
            return False, late

    def _finish(self, rnd: int) -> bool:
        """The function returned from round `rnd`; wait for the other members. False when the
        round had a fault first (this rank reported one, or a peer's came before every member
        returned): the round failed here too, and this rank joins the next one with the others."""
        if not self._stop(rnd):
            return False
        members = self.members
        assert members is not None
        fault = self.coordination.complete(rnd, members)
        if fault is None:
            return True
        # The watcher skips a fault of a finished round: the abort is this thread's to run.
        self._abort(rnd, fault)
        return False

    def _stop(self, rnd: int) -> bool:
        """Take round `rnd` from the watcher; False when it took on a fault first."""
        with self._lock:
            if rnd in self._handling:
                return False
            self._finished.add(rnd)
            return True

    def _recover(self, rnd: int, error: BaseException) -> None:
        members = self.members
        assert members is not None
        if not isinstance(error, RestartInterrupt):
            mine = Fault.now(
                "exception", self.slot, f"{type(error).__name__}: {error}", rnd, f"rank {self.slot}"
            )
            self.coordination.announce_here(rnd, mine, members)
        aborted = self._aborted[rnd]
        if not aborted.wait(self.wrapper.hard_timeout_s):
            raise RestartError(
                f"round {rnd}: the abort did not finish within {self.wrapper.hard_timeout_s:.0f}s "
                "(hard_timeout)"
            ) from error
        release_frames(error, self.wrapper.hard_timeout_s)
        fault = self.coordination.read_fault(rnd)
        self.state = self.state.replace(fault=fault)
        log.warning(
            "ftd: round %d ended (%s on rank %d: %s): restarting in-process",
            rnd,
            fault.kind,
            fault.rank,
            fault.reason,
        )
        if self.wrapper.max_iterations is not None and rnd + 1 >= self.wrapper.max_iterations:
            raise RestartError(
                f"{self.wrapper.max_iterations} rounds used (max_iterations); last fault: "
                f"{fault.reason}"
            ) from error
        if self.wrapper.finalize is not None:
            self.wrapper.finalize(self.state)
        if self.wrapper.health_check is not None:
            self.wrapper.health_check(self.state)

    def report_fault(self, reason: str) -> None:
        members = self.members
        if members is None:
            return
        rnd = self.state.iteration
        fault = Fault.now("exception", self.slot, reason, rnd, f"rank {self.slot}")
        self.coordination.announce_here(rnd, fault, members)

    # -- the watcher and watchdog threads -------------------------------------------------

    def _on_fault(self, rnd: int, fault: Fault) -> None:
        """Watcher thread: round `rnd` has a fault. Interrupt the function, then abort."""
        with self._lock:
            if rnd in self._finished:
                return
            self._handling.add(rnd)
        with self.atomic_lock:  # never inside the function's atomic() section
            self.interrupter.interrupt()
            self._abort(rnd, fault)

    def _abort(self, rnd: int, fault: Fault) -> None:
        state = self.state.replace(fault=fault)
        try:
            self.wrapper.abort(state)
        except Exception:
            log.exception("ftd: the abort of round %d failed", rnd)
        self._aborted[rnd].set()

    def _on_soft_timeout(self, rnd: int, stalled_s: float) -> None:
        """Watchdog thread: the function made no progress for `stalled_s`."""
        members = self.members
        if members is None:
            return
        if self._watchdog_store is None:
            self._watchdog_store = self.coordination.client(self.wrapper.barrier_timeout_s)
        reason = (
            f"rank {self.slot} made no progress for {stalled_s:.1f}s "
            f"(soft_timeout {self.wrapper.soft_timeout_s:g}s)"
        )
        log.error("ftd: %s", reason)
        fault = Fault.now("soft_timeout", self.slot, reason, rnd, f"rank {self.slot}")
        try:
            self.coordination.announce(self._watchdog_store, rnd, fault, members)
        except Exception as error:
            log.error("ftd: could not announce the soft timeout: %s", error)

    def close(self) -> None:
        self.watchdog.stop()
        self.watcher.stop()
        # A daemon thread still inside a store call when the interpreter exits is torn down
        # mid-C++ and aborts the process (std::terminate): let the watcher leave its wait
        # (its round was stopped) before the process may exit.
        self.watcher.join(CLOSE_JOIN_TIMEOUT_S)
        self.watchdog.join(CLOSE_JOIN_TIMEOUT_S)
        self.interrupter.restore()
        self.coordination.close()
