"""Process groups whose real group lives in a child ("baby") process that can be killed.

gloo cannot abandon a collective that its own process started (see `ftd_client.process_group`);
killing the process that holds the group can. The child side is in `ftd_client._baby`.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
from torch._C._distributed_c10d import Work
from torch.futures import Future

from ftd_client._baby import BabyChild, Outcome
from ftd_client._c10d import (
    ProcessGroup,
    allgather_args,
    allreduce_args,
    broadcast_args,
    parse_store_addr,
    require_nccl,
)

log = logging.getLogger("ftd_client.process_group")


def _timeout_s(timeout: float | timedelta) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class _BabyWork(Work):
    """A collective running in the baby process. `wait` gives up after the group's timeout (or
    the one given) and then kills the baby: its group cannot be trusted afterwards."""

    def __init__(self, child: BabyChild, done: Outcome, result: object, timeout_s: float) -> None:
        super().__init__()
        self._child = child
        self._op = done.op
        self._done = done
        self._result = result
        self._timeout_s = timeout_s
        self._torch_future: Future[object] | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        limit = self._timeout_s
        if timeout is not None and timeout > timedelta(0):
            limit = timeout.total_seconds()
        if not self._done.wait(limit):
            self._child.kill(f"was killed: {self._op} not done after {limit:g} s")
            raise TimeoutError(
                f"{self._op} did not finish within {limit:g} s; killed baby process "
                f"{self._child.pid}: call configure() to start a fresh group"
            )
        self._done.result()
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def get_future(self) -> Future[object]:
        if self._torch_future is None:
            fut: Future[object] = Future()
            result = self._result

            def settle() -> None:
                error = self._done.error
                if error is None:
                    fut.set_result(result)
                else:
                    fut.set_exception(error)

            self._done.on_done(settle)
            self._torch_future = fut
        return self._torch_future


class ProcessGroupBaby(ProcessGroup):
    """The real group lives in a child ("baby") process, so a hung collective can be abandoned
    by killing it. `configure` kills the previous baby and spawns a fresh one. CPU tensors are
    moved to shared memory (`share_memory_()`, in place) before they are handed over; the baby
    reduces into the same pages. A killed or dead baby fails every pending Work at once."""

    BACKEND = ""

    def __init__(self, timeout: float | timedelta = 60.0) -> None:
        super().__init__()
        self._timeout_s = _timeout_s(timeout)
        self._child: BabyChild | None = None
        self._rank = 0
        self._world = 1

    @property
    def child_pid(self) -> int | None:
        """The baby's pid, None before the first configure."""
        return None if self._child is None else self._child.pid

    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        parse_store_addr(store_addr)
        old, self._child = self._child, None
        if old is not None:
            old.kill("was replaced by configure()")
        self._child = BabyChild.start(self.BACKEND, store_addr, rank, world_size, self._timeout_s)
        self._rank, self._world = rank, world_size
        log.info(
            "%s configured: rank %d of %d at %s in baby process %d",
            self.getBackendName(),
            rank,
            world_size,
            store_addr,
            self._child.pid,
        )

    def shutdown(self) -> None:
        """Kill the baby process; collectives fail until the next configure."""
        if self._child is not None:
            self._child.kill("was shut down")

    def _submit(self, op: str, tensors: list[Any], payload: tuple[Any, ...], result: object) -> Any:
        if self._child is None:
            raise RuntimeError(f"{type(self).__name__} is not configured: call configure() first")
        for tensor in tensors:
            self._prepare(tensor)
        done = self._child.submit(op, payload)
        return _BabyWork(self._child, done, result, self._timeout_s)

    def _prepare(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "cpu" and not tensor.is_shared():
            tensor.share_memory_()

    def allreduce(self, *args: Any, **kwargs: Any) -> Any:
        tensors, opts = allreduce_args(args, kwargs)
        return self._submit("allreduce", tensors, (tensors, opts.reduceOp), tensors)

    def allgather(self, *args: Any, **kwargs: Any) -> Any:
        outputs, inputs, _ = allgather_args(args, kwargs)
        flat = [o for out in outputs for o in out] + inputs
        return self._submit("allgather", flat, (outputs, inputs), outputs)

    def broadcast(self, *args: Any, **kwargs: Any) -> Any:
        tensors, opts = broadcast_args(args, kwargs)
        return self._submit("broadcast", tensors, (tensors, opts.rootRank), tensors)

    def barrier(self, *args: Any, **kwargs: Any) -> Any:
        return self._submit("barrier", [], (), None)

    def getRank(self) -> int:
        return self._rank

    def getSize(self) -> int:
        return self._world


class ProcessGroupBabyGloo(ProcessGroupBaby):
    """Gloo in a killable child process."""

    BACKEND = "gloo"

    def getBackendName(self) -> str:
        return "ftd-baby-gloo"


class ProcessGroupBabyNCCL(ProcessGroupBaby):
    """NCCL in a killable child process. CUDA tensors reach the child through CUDA IPC; the
    caller's stream is synchronized before a collective is handed over and the child
    synchronizes before it reports completion, so `wait()` is CPU-synchronous. Untested in
    ftd's CI (no GPU there). The child costs its own CUDA context (about 1 GB)."""

    BACKEND = "nccl"

    def __init__(self, timeout: float | timedelta = 60.0) -> None:
        require_nccl("ProcessGroupBabyNCCL")
        super().__init__(timeout)

    def _prepare(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "cuda":
            torch.cuda.current_stream(tensor.device).synchronize()
        else:
            super()._prepare(tensor)

    def getBackendName(self) -> str:
        return "ftd-baby-nccl"
