"""Per-attempt log layout: torchrun's, laid out without importing torch.

`<log_dir>/<run_id>/attempt_<n>/<local_rank>/{stdout.log,stderr.log,error.json}`, as
torch.distributed.elastic's DefaultLogsSpecs makes it, with one difference: torchrun puts a
random suffix after the run id; ftd keeps the run directory stable so the daemon's own files
(state, events, socket) sit beside the attempts and survive a daemon restart. A stream is
redirected to its file by `--redirects` or `--tee` (1 stdout, 2 stderr, 3 both); a rank left out
by `--local-ranks-filter` writes its unredirected streams to /dev/null and tees nothing.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

from ftd.config.serve import parse_std

OUT, ERR = 1, 2
CONSOLE = ""
"""A stream left to the daemon's own (torchrun's "")."""


@dataclass
class AttemptLogs:
    """For each local rank, where its streams and error file go (torch's LogsDest, by field)."""

    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    tee_stdouts: dict[int, str] = field(default_factory=dict)
    tee_stderrs: dict[int, str] = field(default_factory=dict)
    error_files: dict[int, str] = field(default_factory=dict)


def _per_rank(value: str, nprocs: int) -> dict[int, int]:
    parsed = parse_std(value)
    if isinstance(parsed, int):
        return dict.fromkeys(range(nprocs), parsed)
    return {rank: parsed.get(rank, 0) for rank in range(nprocs)}


def lay_out_attempt(
    log_dir: str,
    redirects: str,
    tee: str,
    local_ranks_filter: set[int] | None,
    envs: dict[int, dict[str, str]],
) -> AttemptLogs:
    """Blocking: make the attempt's directories (a previous one of the same number is
    removed) and say where each rank's output goes; sets each rank's TORCHELASTIC_ERROR_FILE."""
    nprocs = len(envs)
    first = envs.get(0, {})
    run_dir = os.path.join(log_dir or ".", first.get("TORCHELASTIC_RUN_ID", "none"))
    attempt_dir = os.path.join(run_dir, f"attempt_{first.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    shutil.rmtree(attempt_dir, ignore_errors=True)
    os.makedirs(attempt_dir)
    tees = _per_rank(tee, nprocs)
    redirected = {rank: std | tees[rank] for rank, std in _per_rank(redirects, nprocs).items()}
    logs = AttemptLogs()
    for rank in range(nprocs):
        rank_dir = os.path.join(attempt_dir, str(rank))
        os.mkdir(rank_dir)
        filtered = local_ranks_filter is not None and rank not in local_ranks_filter
        for std, paths, tee_paths, name in (
            (OUT, logs.stdouts, logs.tee_stdouts, "stdout.log"),
            (ERR, logs.stderrs, logs.tee_stderrs, "stderr.log"),
        ):
            if redirected[rank] & std:
                paths[rank] = os.path.join(rank_dir, name)
                if tees[rank] & std and not filtered:
                    tee_paths[rank] = paths[rank]
            else:
                paths[rank] = os.devnull if filtered else CONSOLE
        logs.error_files[rank] = os.path.join(rank_dir, "error.json")
        envs[rank]["TORCHELASTIC_ERROR_FILE"] = logs.error_files[rank]
    return logs
