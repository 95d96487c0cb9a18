"""Fault-tolerant process groups: collectives whose membership can change while the job runs.

Every group here is a `torch.distributed.ProcessGroup` (Python subclasses reach C++ through
torch's trampoline, so `dist.all_reduce(t, group=pg)`, functional collectives and DeviceMesh
see the Python methods) plus one method torch's groups lack:

    pg.configure("host:port/prefix", rank, world_size)

which throws the current membership away and builds a new one over a TCPStore under a prefix
that must be unique per configuration. Rank and size may differ after each call; code that
holds `pg.size()` across a `configure` holds a stale number.

What gloo does when things go wrong (measured with torch 2.13, CPU, loopback):
- `abort()` on a gloo group returns at once and releases nothing.
- A rank blocked in a gloo collective is *not* released when another thread of the same rank
  destroys its group; dropping the last reference even blocks that thread until the collective
  times out. It is released within about 0.5 s when a *peer* destroys its group (its sockets
  close) or dies.
- Only a rank waiting on the dead peer itself is released that fast. One waiting on a live
  peer, whose own collective has already failed, waits for the gloo timeout: a failed
  collective does not close the group's sockets. Keep gloo's timeout short where failures
  must be noticed quickly.
So a rank cannot abandon its own pending gloo collective. `ProcessGroupGloo.configure` drops the
old group on a background thread (it may linger there until its timeout); the Baby groups run
the real group in a child process that `configure`, or a `Work.wait` that times out, kills.

Choose:
- `ProcessGroupGloo` / `ProcessGroupNCCL`: the group lives in this process; cheapest.
- `ProcessGroupBabyGloo` / `ProcessGroupBabyNCCL`: the group lives in a child process that can
  be killed; tensors travel through shared memory.
- `ErrorSwallowingProcessGroupWrapper`: errors are recorded, not raised, until `configure`.
- `ManagedProcessGroup`: a manager owns the group, its size and its errors.
- `ProcessGroupDummy`: every collective completes at once (tests, skipped steps).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Protocol

import torch
from torch._C._distributed_c10d import ProcessGroup as BaseProcessGroup
from torch._C._distributed_c10d import Store

from ftd_client._baby import BabyDiedError, CollectiveError
from ftd_client._baby_group import ProcessGroupBaby, ProcessGroupBabyGloo, ProcessGroupBabyNCCL
from ftd_client._c10d import (
    DEFAULT_TIMEOUT,
    DummyWork,
    ProcessGroup,
    StoreAddress,
    SwallowingWork,
    allgather_args,
    allreduce_args,
    broadcast_args,
    create_store_client,
    new_gloo_group,
    new_nccl_group,
    parse_store_addr,
    require_nccl,
    retire,
)

__all__ = [
    "BabyDiedError",
    "CollectiveError",
    "ErrorSwallowingProcessGroupWrapper",
    "ManagedProcessGroup",
    "Manager",
    "ProcessGroup",
    "ProcessGroupBaby",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupDummy",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupWrapper",
    "StoreAddress",
    "create_store_client",
    "extend_device_mesh",
    "parse_store_addr",
]

log = logging.getLogger("ftd_client.process_group")

# --- wrappers ----------------------------------------------------------------------------------


class ProcessGroupWrapper(ProcessGroup):
    """Forwards everything to `parent`; `configure` reconfigures the parent."""

    def __init__(self, pg: BaseProcessGroup | None = None) -> None:
        super().__init__()
        self._pg = pg

    @property
    def parent(self) -> Any:
        if self._pg is None:
            raise RuntimeError(f"{type(self).__name__} is not configured: call configure() first")
        return self._pg

    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        pg = self.parent
        if not isinstance(pg, ProcessGroup):
            raise TypeError(f"cannot configure a {type(pg).__name__}: it is not reconfigurable")
        pg.configure(store_addr, rank, world_size)

    def allreduce(self, *args: Any, **kwargs: Any) -> Any:
        return self.parent.allreduce(*args, **kwargs)

    def allgather(self, *args: Any, **kwargs: Any) -> Any:
        return self.parent.allgather(*args, **kwargs)

    def broadcast(self, *args: Any, **kwargs: Any) -> Any:
        return self.parent.broadcast(*args, **kwargs)

    def barrier(self, *args: Any, **kwargs: Any) -> Any:
        return self.parent.barrier(*args, **kwargs)

    def getRank(self) -> int:
        return int(self.parent.rank())

    def getSize(self) -> int:
        return int(self.parent.size())

    def getBackendName(self) -> str:
        return str(self.parent.name())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pg={self._pg!r})"


class _RebuiltGroup(ProcessGroupWrapper):
    """A plain c10d group that each `configure` replaces with a new one built over
    `create_store_client(store_addr)`."""

    def __init__(self, timeout: timedelta) -> None:
        super().__init__()
        self._timeout = timeout

    def _new_group(self, store: Store, rank: int, world_size: int) -> BaseProcessGroup:
        raise NotImplementedError

    def _release(self, pg: BaseProcessGroup) -> None:
        """Called on the old group before it is dropped."""

    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        old = [] if self._pg is None else [self._pg]
        self._pg = None
        if old:
            self._release(old[0])
        retire(old)  # the last reference goes on a daemon thread; see `retire`
        store = create_store_client(store_addr, self._timeout)
        self._pg = self._new_group(store, rank, world_size)
        log.info(
            "%s configured: rank %d of %d at %s",
            self.getBackendName(),
            rank,
            world_size,
            store_addr,
        )


class ProcessGroupGloo(_RebuiltGroup):
    """Gloo, rebuilt by each `configure`; `timeout` bounds building the group and every
    collective.

    The previous group is dropped on a background thread: if one of its collectives is still
    pending, it lingers there until that collective times out (gloo cannot abort it).
    """

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout)

    def _new_group(self, store: Store, rank: int, world_size: int) -> BaseProcessGroup:
        return new_gloo_group(store, rank, world_size, self._timeout)

    def getBackendName(self) -> str:
        return "ftd-gloo"


class ProcessGroupNCCL(_RebuiltGroup):
    """NCCL, rebuilt by each `configure`; the old communicator is aborted first.

    Constructing it without CUDA and NCCL raises. NCCL's own error handling may still deadlock
    a rank, which is what `ProcessGroupBabyNCCL` is for.
    """

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        require_nccl("ProcessGroupNCCL")
        super().__init__(timeout)

    def _new_group(self, store: Store, rank: int, world_size: int) -> BaseProcessGroup:
        return new_nccl_group(store, rank, world_size, self._timeout)

    def _release(self, pg: BaseProcessGroup) -> None:
        pg.abort()

    def getBackendName(self) -> str:
        return "ftd-nccl"


class _SwallowingWrapper(ProcessGroupWrapper):
    """Collectives whose failures go to `_report` and then succeed with dummy results."""

    def _report(self, e: Exception) -> None:
        raise NotImplementedError

    def _skipping(self) -> bool:
        return False

    def _guard(self, call: Any, default: object, args: Any, kwargs: Any) -> Any:
        if self._skipping():
            return DummyWork(default)
        try:
            work = call(*args, **kwargs)
        except Exception as e:
            self._report(e)
            return DummyWork(default)
        return SwallowingWork(work, self._report, default)

    def allreduce(self, *args: Any, **kwargs: Any) -> Any:
        tensors, _ = allreduce_args(args, kwargs)
        return self._guard(self.parent.allreduce, tensors, args, kwargs)

    def allgather(self, *args: Any, **kwargs: Any) -> Any:
        outputs, _, _ = allgather_args(args, kwargs)
        return self._guard(self.parent.allgather, outputs, args, kwargs)

    def broadcast(self, *args: Any, **kwargs: Any) -> Any:
        tensors, _ = broadcast_args(args, kwargs)
        return self._guard(self.parent.broadcast, tensors, args, kwargs)

    def barrier(self, *args: Any, **kwargs: Any) -> Any:
        return self._guard(self.parent.barrier, None, args, kwargs)


class ErrorSwallowingProcessGroupWrapper(_SwallowingWrapper):
    """Records the first error of a collective (raised by the call or by its Work) instead of
    raising it; from then on every collective returns an already-completed dummy Work and leaves
    its tensors alone, until `configure` clears the error. Check `error()` once per step."""

    def __init__(self, pg: BaseProcessGroup) -> None:
        super().__init__(pg)
        self._error: Exception | None = None

    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        self._error = None
        super().configure(store_addr, rank, world_size)

    def report_error(self, e: Exception) -> None:
        """Skip every collective until the next `configure`."""
        if self._error is None:
            log.warning("collective failed; skipping collectives until configure(): %s", e)
            self._error = e

    def error(self) -> Exception | None:
        """The first error since the last `configure`, or None."""
        return self._error

    def _report(self, e: Exception) -> None:
        self.report_error(e)

    def _skipping(self) -> bool:
        return self._error is not None


class Manager(Protocol):
    """What ManagedProcessGroup needs from a manager: its current group, the number of live
    participants, an allreduce it controls (it picks the reduction) and an error sink."""

    @property
    def pg(self) -> Any: ...

    def num_participants(self) -> int: ...

    def allreduce(self, tensor: torch.Tensor) -> Any: ...

    def report_error(self, e: Exception) -> None: ...


class ManagedProcessGroup(_SwallowingWrapper):
    """The manager's group as a process group for model code: `size()` is the number of live
    participants, allreduce goes through `manager.allreduce`, and errors go to
    `manager.report_error` while the caller sees success (dummy results)."""

    def __init__(self, manager: Manager) -> None:
        super().__init__(manager.pg)
        self._manager = manager

    @property
    def parent(self) -> Any:
        return self._manager.pg

    def _report(self, e: Exception) -> None:
        self._manager.report_error(e)

    def allreduce(self, *args: Any, **kwargs: Any) -> Any:
        tensors, _ = allreduce_args(args, kwargs)
        if len(tensors) != 1:
            raise ValueError(
                f"ManagedProcessGroup reduces one tensor at a time, not {len(tensors)}"
            )
        return self._guard(self._manager.allreduce, tensors, tensors, {})

    def getSize(self) -> int:
        return self._manager.num_participants()

    def getBackendName(self) -> str:
        return f"ftd-managed-{self.parent.name()}"


# --- dummy -------------------------------------------------------------------------------------


class ProcessGroupDummy(ProcessGroup):
    """Every collective completes at once: allreduce and broadcast leave tensors unchanged,
    allgather fills each output with this rank's input (as if every member held the same data).
    `configure` takes the new rank and size and counts itself in `configure_count`."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self._rank = rank
        self._world = world
        self.configure_count = 0

    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        self._rank, self._world = rank, world_size
        self.configure_count += 1

    def allreduce(self, *args: Any, **kwargs: Any) -> Any:
        tensors, _ = allreduce_args(args, kwargs)
        return DummyWork(tensors)

    def allgather(self, *args: Any, **kwargs: Any) -> Any:
        outputs, inputs, _ = allgather_args(args, kwargs)
        for out, tensor in zip(outputs, inputs, strict=True):
            for o in out:
                o.copy_(tensor)
        return DummyWork(outputs)

    def broadcast(self, *args: Any, **kwargs: Any) -> Any:
        tensors, _ = broadcast_args(args, kwargs)
        return DummyWork(tensors)

    def barrier(self, *args: Any, **kwargs: Any) -> Any:
        return DummyWork(None)

    def getRank(self) -> int:
        return self._rank

    def getSize(self) -> int:
        return self._world

    def getBackendName(self) -> str:
        return "ftd-dummy"


# --- device mesh -------------------------------------------------------------------------------


def extend_device_mesh(mesh: Any, pg: ProcessGroup, name: str = "dp", dim: int = 0) -> Any:
    """A DeviceMesh with `pg` as an extra dimension `name` at position `dim`.

    DeviceMesh has no notion of a group that resizes, so the new dimension claims size 1: each
    replica sees only itself along it, while collectives over it reach every live member of
    `pg`. Scale numerics at the process-group level (e.g. divide by `pg.size()`), not by the
    mesh's sizes. `pg` must be registered (`pg.register(name)`) so functional collectives can
    resolve it, and `mesh` needs dimension names. Building a DeviceMesh needs torch's default
    process group (`init_process_group`), as DeviceMesh always does; verified on CPU/gloo.
    """
    from torch.distributed.device_mesh import DeviceMesh

    if not pg.group_name:
        raise ValueError("register the process group first: pg.register(name)")
    if mesh.mesh_dim_names is None:
        raise ValueError("extend_device_mesh needs a mesh with mesh_dim_names")
    groups = list(mesh.get_all_groups())
    groups.insert(dim, pg)
    names = list(mesh.mesh_dim_names)
    names.insert(dim, name)
    return DeviceMesh.from_group(
        groups, device_type=mesh.device_type, mesh=mesh.mesh.unsqueeze(dim), mesh_dim_names=names
    )
