"""RoundManager: the Wrapper's round as the quorum of a ManagedProcessGroup.

    @inprocess.Wrapper()
    def train(call_wrapper: inprocess.CallWrapper | None = None) -> None:
        manager = inprocess.RoundManager(call_wrapper)
        pg = ManagedProcessGroup(manager)   # size(): the round's live participants
        ...

The daemon decides who takes part in each round (a dead rank is dropped or replaced), so the
manager's participants are the round's members and its group is rebuilt over the round's
store. An error the ManagedProcessGroup swallows ends the round on every rank: the training
code sees dummy results until the interrupt arrives, then the Wrapper restarts it in-process.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ftd_client.inprocess.call_wrapper import CallWrapper
    from ftd_client.process_group import ProcessGroup


class RoundManager:
    """A `ftd_client.process_group.Manager` for one round of the Wrapper.

    Builds `pg` (default: a `ProcessGroupGloo` with `timeout`) over the round's store
    (MASTER_ADDR:MASTER_PORT, set by the Wrapper) under `prefix`; create one at the start of
    each round. `allreduce` sums, as `dist.all_reduce` does; `errors` holds what was reported.
    """

    def __init__(
        self,
        call_wrapper: CallWrapper | None,
        pg: ProcessGroup | None = None,
        timeout: timedelta = timedelta(seconds=60),
        prefix: str = "ftd/managed",
    ) -> None:
        if call_wrapper is None:
            raise TypeError(
                "RoundManager needs the Wrapper's call_wrapper: declare a `call_wrapper` "
                "parameter on the wrapped function and pass it on"
            )
        from ftd_client.process_group import ProcessGroupGloo

        self._call_wrapper = call_wrapper
        self._pg = pg if pg is not None else ProcessGroupGloo(timeout)
        self.errors: list[Exception] = []
        state = call_wrapper.state
        addr = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}/{prefix}"
        self._pg.configure(addr, state.rank, state.world_size)

    @property
    def pg(self) -> ProcessGroup:
        return self._pg

    def num_participants(self) -> int:
        return self._call_wrapper.state.world_size

    def allreduce(self, tensor: torch.Tensor) -> Any:
        import torch.distributed as dist

        return self._pg.allreduce([tensor], dist.ReduceOp.SUM)

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)
        if len(self.errors) == 1:
            self._call_wrapper.report_fault(f"{type(e).__name__}: {e}")
