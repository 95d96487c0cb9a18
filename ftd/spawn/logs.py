"""Per-attempt log layout, on top of torch.distributed.elastic's DefaultLogsSpecs.

`<log_dir>/<run_id>/attempt_<n>/<local_rank>/{stdout.log,stderr.log,error.json}`: torchrun
puts a random suffix after the run id; ftd keeps the run directory stable so the daemon's own
files (state, events, socket) sit beside the attempts and survive a daemon restart.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ftd.text import is_decimal

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

STD_VALUES = {"0": 0, "1": 1, "2": 2, "3": 3}


def parse_std(value: str) -> int | dict[int, int]:
    """torchrun's `--redirects/--tee` value: `N` for every rank or `rank:N,rank:N`; N in 0..3."""
    if value in STD_VALUES:
        return STD_VALUES[value]
    mapping: dict[int, int] = {}
    for item in value.split(","):
        rank, sep, std = item.partition(":")
        if not sep or not is_decimal(rank.strip()) or std.strip() not in STD_VALUES:
            raise ValueError(f"expected 0-3 or local_rank:0-3[,...], got {value!r}")
        mapping[int(rank)] = STD_VALUES[std.strip()]
    return mapping


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
