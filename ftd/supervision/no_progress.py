"""A job that knows when to stop: restarts that make no progress are not tried forever.

Progress is the job's checkpoint iteration: the newest step its ranks saved and could resume
from (ftd_client.checkpoint's snapshots, in the node's memory or persisted), or the number in
`--ft-checkpoint-iteration-file` (NVRx's: a file the script rewrites with its latest
checkpoint's iteration). An attempt made progress when that iteration grew by at least
`min_progress_iterations` during it; after `max_no_progress_cycles` attempts in a row that made
none, the job is not restarted again: every node stops with `no_restart_exit_code` (93, as
NVRx's launchers), so a scheduler's requeue does not spend the allocation on a job that cannot
move. Where the job reports no iteration at all, nothing is judged (as NVRx). Restarts running
out keep their own exit code (1).

Pure apart from the iteration file's read: the tests drive `attempt_ended` with iterations.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ftd.config.ft import FaultToleranceConfig
from ftd.status.event_kind import EventKind
from ftd.status.events import EventLog
from ftd.status.model import Failure
from ftd.supervision.policy import Stuck

log = logging.getLogger("ftd.supervision")

MAX_ITERATION_FILE_BYTES = 64
MAX_ITERATION = 2**63 - 1


@dataclass
class NoProgress:
    max_cycles: int
    """Attempts in a row without progress before the job stops (<= 0: never)."""
    min_iterations: int = 1
    last: int | None = None
    """The iteration when the current attempt began (None: none reported yet)."""
    without: int = 0
    """Attempts in a row that made no progress."""

    def attempt_ended(self, iteration: int | None) -> str | None:
        """The attempt that just failed had reached `iteration` (None: unknown); the reason the
        job must stop, or None."""
        if self.max_cycles <= 0 or iteration is None:
            return None
        before = self.last if self.last is not None else 0
        if iteration - before >= self.min_iterations:
            self.without = 0
        else:
            self.without += 1
        self.last = max(iteration, before)
        if self.without < self.max_cycles:
            if self.without:
                log.warning(
                    "no progress in %d attempt(s) in a row (checkpoint iteration %d; the job "
                    "stops after %d)",
                    self.without,
                    self.last,
                    self.max_cycles,
                )
            return None
        return (
            f"no progress in {self.without} attempts (the checkpoint iteration stayed at "
            f"{self.last}; --ft-max-no-progress-cycles {self.max_cycles})"
        )


class Snapshots(Protocol):
    """The node's memory tier (ftd/checkpoint/holder.py), as far as progress goes."""

    def newest_step(self) -> int | None: ...


class ProgressGuard:
    """The job's checkpoint iteration after each failed attempt, from its source: the
    iteration file where one is configured, else the node's memory tier."""

    def __init__(self, ft: FaultToleranceConfig, events: EventLog) -> None:
        self._ft = ft
        self._events = events
        self.tracker = NoProgress(ft.max_no_progress_cycles, ft.min_progress_iterations)

    def after_failure(
        self, attempt: int, failure: Failure | None, snapshots: Snapshots | None
    ) -> Stuck | None:
        """`failure` ended `attempt` (None: another node's, counted): Stuck when restarting
        cannot help. A failure that is not counted (a lost node) judges nothing."""
        if failure is not None and not failure.counted:
            return None
        if self._ft.checkpoint_iteration_file is not None:
            iteration = read_iteration_file(Path(self._ft.checkpoint_iteration_file))
        else:
            iteration = snapshots.newest_step() if snapshots is not None else None
        reason = self.tracker.attempt_ended(iteration)
        if reason is None:
            return None
        code = self._ft.no_restart_exit_code
        self._events.emit(
            EventKind.NO_PROGRESS,
            attempt=attempt,
            attempts=self.tracker.without,
            iteration=self.tracker.last,
            exit_code=code,
            reason=reason,
        )
        return Stuck(reason, code)


def read_iteration_file(path: Path) -> int | None:
    """The iteration in NVRx's checkpoint iteration file (decimal digits, whitespace around
    them): a regular file opened without following a link or blocking on a FIFO, at most
    MAX_ITERATION_FILE_BYTES; None for a file that is missing, not one, or holds anything
    else (a write the script is in the middle of reads as unknown, never as 0)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        return decode_iteration(os.read(fd, MAX_ITERATION_FILE_BYTES + 1))
    except OSError:
        return None
    finally:
        os.close(fd)


def decode_iteration(data: bytes) -> int | None:
    """The `iteration_file` decoder: an integer 0 .. 2^63-1 written in ASCII digits, or None."""
    if len(data) > MAX_ITERATION_FILE_BYTES:
        return None
    text = data.strip(b" \t\r\n")
    if not text or len(text) > 19 or not text.isdigit():
        return None
    value = int(text)
    return value if value <= MAX_ITERATION else None
