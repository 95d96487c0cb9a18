"""Per-attempt log layout, on top of torch.distributed.elastic's DefaultLogsSpecs.

`<log_dir>/<run_id>/attempt_<n>/<local_rank>/{stdout.log,stderr.log,error.json}`: torchrun
puts a random suffix after the run id; ftd keeps the run directory stable so the daemon's own
files (state, events, socket) sit beside the attempts and survive a daemon restart.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ftd.config.serve import parse_std

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std


def to_std(value: str) -> Std | dict[int, Std]:
    from torch.distributed.elastic.multiprocessing import Std

    parsed = parse_std(value)
    if isinstance(parsed, int):
        return Std(parsed)
    return {rank: Std(std) for rank, std in parsed.items()}


def make_logs_specs(
    log_dir: str, redirects: str, tee: str, local_ranks_filter: set[int] | None
) -> DefaultLogsSpecs:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    class StableRunDirLogsSpecs(DefaultLogsSpecs):  # type: ignore[misc]
        def _make_log_dir(self, log_dir: str | None, rdzv_run_id: str) -> str:
            run_dir = os.path.join(log_dir or ".", rdzv_run_id)
            os.makedirs(run_dir, exist_ok=True)
            return run_dir

    return StableRunDirLogsSpecs(
        log_dir=log_dir,
        redirects=to_std(redirects),
        tee=to_std(tee),
        local_ranks_filter=local_ranks_filter,
    )
