"""The subprocess start method: torch.distributed.elastic's PContext, as torchrun uses it.

Its redirected streams are the pipes of the attempt's OutputPlan (ftd/ranks/spawn/output.py), not
the log files: PContext opens what it is given, and `/proc/self/fd/<write end>` opens the pipe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from typing import TYPE_CHECKING

from ftd.ranks.spawn.base import LaunchSpec, RankHandle, RankStream
from ftd.ranks.spawn.output import OutputPlan, plan_output

RANK_START_WANTED = (("FTD_PROGRESS", "1"), ("FTD_RESTART_MODE", "inprocess"))
"""ftd_client.rank_start.WANTED (not imported: it would load the rank-side parts)."""
SCRIPT_BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "script_boot.py")

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.api import LogsSpecs, SubprocessContext


class _DropSignalHandlerWarning(logging.Filter):
    """PContext warns that it cannot install signal handlers off the main thread; the daemon
    handles signals itself, so the warning would only mislead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to register signal handlers" not in record.getMessage()


logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
    _DropSignalHandlerWarning()
)


class PContextGroup:
    def __init__(self, context: SubprocessContext, attempt_log_dir: str, plan: OutputPlan) -> None:
        self._context = context
        self.attempt_log_dir = attempt_log_dir
        self.streams: list[RankStream] = plan.streams
        handlers = context.subprocess_handlers
        self.ranks = {
            local_rank: RankHandle(
                local_rank=local_rank,
                pid=handler.proc.pid,
                error_file=context.error_files[local_rank],
                stdout=plan.dest.stdouts[local_rank],
                stderr=plan.dest.stderrs[local_rank],
            )
            for local_rank, handler in handlers.items()
        }

    def reap(self, local_rank: int) -> int | None:
        code: int | None = self._context.subprocess_handlers[local_rank].proc.poll()
        return code

    def kill(self, local_rank: int, sig: signal.Signals) -> None:
        # Each rank leads its own session (start_new_session), so its pgid is its pid and the
        # group reaches the rank's children (DataLoader workers) even after the rank is gone.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.ranks[local_rank].pid, sig)

    def close(self) -> None:
        self._context.close(timeout=1)


class PContextSpawner:
    name = "subprocess"

    def prepare(self) -> None:
        pass

    def close(self) -> None:
        pass

    def start(self, spec: LaunchSpec) -> PContextGroup:
        from torch.distributed.elastic.multiprocessing import start_processes

        plan = plan_output(spec)
        try:
            context = start_processes(
                name=spec.name,
                entrypoint=spec.cmd[0],
                args={lr: rank_command(spec, lr)[1:] for lr in spec.envs},
                envs=spec.envs,
                logs_specs=_planned_logs(plan, spec.log_dir),
                log_line_prefixes=spec.log_line_prefixes,
            )
        except BaseException:
            plan.close()
            raise
        plan.close_child_ends()  # each rank holds its own (and PContext a copy, until close)
        run_id = spec.envs[0].get("TORCHELASTIC_RUN_ID", "none")
        attempt = spec.envs[0].get("TORCHELASTIC_RESTART_COUNT", "0")
        return PContextGroup(
            context, os.path.join(spec.log_dir, run_id, f"attempt_{attempt}"), plan
        )


def rank_command(spec: LaunchSpec, local_rank: int) -> tuple[str, ...]:
    """spec.cmd; for a Python rank whose environment wants a rank start (FTD_PROGRESS=1 or
    FTD_RESTART_MODE=inprocess: ftd_client/rank_start.py), the same run through
    script_boot.py, which observes its progress first (a forked rank is observed by rank_main)."""
    env = {**os.environ, **spec.envs[local_rank]}
    wanted = any(env.get(name) == value for name, value in RANK_START_WANTED)
    if not spec.python or not wanted or len(spec.cmd) < 3:
        return spec.cmd
    python, flag, *rest = spec.cmd
    return (python, flag, SCRIPT_BOOT, *rest)


def _planned_logs(plan: OutputPlan, log_dir: str) -> LogsSpecs:
    """The plan as PContext takes it: the pipes for redirected streams, and nothing to tail
    (the daemon tees what it reads)."""
    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

    dest = LogsDest(
        stdouts={lr: plan.child_path(lr, "stdout") for lr in plan.dest.stdouts},
        stderrs={lr: plan.child_path(lr, "stderr") for lr in plan.dest.stderrs},
        tee_stdouts={},
        tee_stderrs={},
        error_files=plan.dest.error_files,
    )

    class Planned(LogsSpecs):  # type: ignore[misc]
        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            return dest

        @property
        def root_log_dir(self) -> str:
            return log_dir

    return Planned(log_dir)
