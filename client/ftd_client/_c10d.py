"""torch c10d plumbing for the fault-tolerant groups: the `ProcessGroup` base class, store
clients, plain groups built without torch's global state, the canonical form of each
collective's arguments, and Works that are already done or that swallow errors.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    BroadcastOptions,
    PrefixStore,
    ReduceOp,
    Store,
    Work,
    _register_process_group,
    _unregister_process_group,
)
from torch._C._distributed_c10d import ProcessGroup as BaseProcessGroup
from torch.futures import Future

from ftd_client.store import tcp_store_client

DEFAULT_TIMEOUT = timedelta(seconds=60)
_ADDR = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[^:/\[\]]+):(?P<port>\d+)/(?P<prefix>.+)$")

# --- store addresses ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreAddress:
    """`host:port/prefix`: a TCPStore and the key prefix of one configuration."""

    host: str
    port: int
    prefix: str

    def __str__(self) -> str:
        return f"{self.host}:{self.port}/{self.prefix}"


def parse_store_addr(addr: str) -> StoreAddress:
    """Parse `host:port/prefix` (IPv6 hosts in brackets); ValueError says what is wrong."""
    match = _ADDR.match(addr)
    if match is None:
        raise ValueError(
            f"store address {addr!r} is not host:port/prefix (e.g. localhost:29500/run/3); "
            "each configuration needs its own non-empty prefix"
        )
    port = int(match["port"])
    if not 0 < port < 65536:
        raise ValueError(f"store address {addr!r}: port {port} is outside 1..65535")
    return StoreAddress(match["host"].strip("[]"), port, match["prefix"])


def create_store_client(addr: str, timeout: timedelta = DEFAULT_TIMEOUT) -> Store:
    """A `PrefixStore(prefix, TCPStore(host, port))` client for `host:port/prefix`."""
    parsed = parse_store_addr(addr)
    store = tcp_store_client(parsed.host, parsed.port, timeout.total_seconds())
    return PrefixStore(parsed.prefix, store)


# --- collective arguments ----------------------------------------------------------------------
# torch's collectives accept several overloads; these turn each into one canonical form.


def _arg(args: Sequence[Any], kwargs: dict[str, Any], index: int, *names: str) -> Any:
    if len(args) > index:
        return args[index]
    for name in names:
        if name in kwargs:
            return kwargs[name]
    return None


def allreduce_args(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    """(tensors, AllreduceOptions) from any allreduce overload."""
    tensors = _arg(args, kwargs, 0, "tensors", "tensor")
    rest = _arg(args, kwargs, 1, "opts", "op")
    if isinstance(rest, AllreduceOptions):
        opts = rest
    else:
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp(ReduceOp.SUM) if rest is None else rest
    return ([tensors] if isinstance(tensors, torch.Tensor) else list(tensors)), opts


def allgather_args(
    args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[list[list[Any]], list[Any], Any]:
    """(output lists, inputs, AllgatherOptions) from any allgather overload."""
    outputs = _arg(args, kwargs, 0, "output_tensors")
    inputs = _arg(args, kwargs, 1, "input_tensors", "input_tensor")
    opts = _arg(args, kwargs, 2, "opts")
    if isinstance(inputs, torch.Tensor):
        return [list(outputs)], [inputs], opts if opts is not None else AllgatherOptions()
    return (
        [list(out) for out in outputs],
        list(inputs),
        opts if opts is not None else AllgatherOptions(),
    )


def broadcast_args(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    """(tensors, BroadcastOptions) from any broadcast overload."""
    tensors = _arg(args, kwargs, 0, "tensors", "tensor")
    rest = _arg(args, kwargs, 1, "opts", "root")
    if isinstance(rest, BroadcastOptions):
        opts = rest
    else:
        opts = BroadcastOptions()
        opts.rootRank = 0 if rest is None else int(rest)
    return ([tensors] if isinstance(tensors, torch.Tensor) else list(tensors)), opts


# --- works -------------------------------------------------------------------------------------


class DummyWork(Work):
    """A Work that has already succeeded; its future holds `result`."""

    def __init__(self, result: object) -> None:
        super().__init__()
        self._future: Future[object] = Future()
        self._future.set_result(result)

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> Future[object]:
        return self._future


class SwallowingWork(Work):
    """Forwards to `work`; a failure goes to `report` and the Work succeeds with `default`."""

    def __init__(self, work: Any, report: Any, default: object) -> None:
        super().__init__()
        self._work = work
        self._report = report
        self._default = default

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            if timeout is None or timeout == timedelta(0):
                self._work.wait()
            else:
                self._work.wait(timeout)
        except Exception as e:
            self._report(e)
        return True

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def get_future(self) -> Future[object]:
        def settle(fut: Future[object]) -> object:
            try:
                return fut.value()
            except Exception as e:
                self._report(e)
                return self._default

        return self._work.get_future().then(settle)


def retire(box: list[BaseProcessGroup]) -> None:
    """Empty `box` on a daemon thread: a gloo group's destructor waits for its pending
    collectives, up to their timeout. The caller must reach the groups only through `box`, so
    that the last reference really is dropped on that thread."""
    if box:
        threading.Thread(target=box.clear, name="ftd-pg-retire", daemon=True).start()


def new_gloo_group(
    store: Store, rank: int, world_size: int, timeout: timedelta
) -> BaseProcessGroup:
    """A plain c10d ProcessGroup with a gloo backend, without the global default group."""
    backend = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    pg = BaseProcessGroup(store, rank, world_size)
    pg._set_default_backend(BaseProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), BaseProcessGroup.BackendType.GLOO, backend)
    return pg


def require_nccl(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs CUDA, and torch.cuda.is_available() is False")
    if not dist.is_nccl_available():
        raise RuntimeError(f"{what} needs NCCL, and this torch build has none")


def new_nccl_group(
    store: Store, rank: int, world_size: int, timeout: timedelta
) -> BaseProcessGroup:
    """A plain c10d ProcessGroup with an NCCL backend (CUDA tensors only)."""
    require_nccl("an NCCL group")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    backend = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    pg = BaseProcessGroup(store, rank, world_size)
    pg._set_default_backend(BaseProcessGroup.BackendType.NCCL)
    backend._set_sequence_number_for_group()
    pg._register_backend(torch.device("cuda"), BaseProcessGroup.BackendType.NCCL, backend)
    return pg


# --- the base class ----------------------------------------------------------------------------


class ProcessGroup(BaseProcessGroup):
    """A torch ProcessGroup whose membership `configure` can replace.

    Subclasses implement `configure`, the collectives they support, `getRank`, `getSize` and
    `getBackendName`. torch's C++ side calls `getRank`/`getSize`/`getGroupName` through its
    Python trampoline, so `pg.rank()`, `pg.size()` and `pg.group_name` follow them.
    """

    def __init__(self) -> None:
        super().__init__(0, 1)  # type: ignore[call-arg]  # the stub lacks (rank, size)
        self._group_name = ""
        self._registered = False

    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """Replace the membership: `store_addr` is `host:port/prefix`, a new prefix each time.

        Blocks until the new group exists on every member; raises if it cannot be built.
        """
        raise NotImplementedError

    def allreduce(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement allreduce")

    def allgather(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement allgather")

    def broadcast(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement broadcast")

    def barrier(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement barrier")

    def broadcast_one(self, tensor: torch.Tensor, root: int) -> Any:
        """Broadcast one tensor from group rank `root`."""
        opts = BroadcastOptions()
        opts.rootRank = root
        return self.broadcast([tensor], opts)

    def getRank(self) -> int:
        raise NotImplementedError

    def getSize(self) -> int:
        raise NotImplementedError

    def getBackendName(self) -> str:
        raise NotImplementedError

    def rank(self) -> int:
        return self.getRank()

    def size(self) -> int:
        return self.getSize()

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def register(self, name: str) -> ProcessGroup:
        """Name this group in torch's c10d registry, where functional collectives and
        DeviceMesh look groups up. Once per group; `unregister` undoes it."""
        if self._registered:
            raise RuntimeError(f"process group already registered as {self._group_name!r}")
        self._set_group_name(name)
        _register_process_group(name, self)
        self._registered = True
        return self

    def unregister(self) -> None:
        """Remove this group from torch's c10d registry."""
        if not self._registered:
            raise RuntimeError("process group is not registered")
        _unregister_process_group(self._group_name)
        self._registered = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
