"""Where an attempt's rank output goes: torchrun's log layout, with a pipe for every stream that
goes to a file.

torchrun hands each rank its log file: a full disk then fails the rank's own `print` (ENOSPC)
and kills it. Here a redirected stream (`-r`, `-t`) is a pipe instead; the daemon reads it
(ftd/ranks/output.py) and writes whole lines to the file, dropping what it cannot write. The
daemon opens the files (here, in the spawning thread), so a rank never writes to the disk
through its stdout or stderr.

Streams that are not redirected are inherited from the daemon (or /dev/null for ranks left out
by --local-ranks-filter), as torchrun does.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass

from ftd.ranks.spawn.base import LaunchSpec, RankStream, StreamName
from ftd.ranks.spawn.logs import AttemptLogs, lay_out_attempt

PIPE_SIZE = 1 << 20
"""What a rank may write while the daemon is not reading (paused, starved) before its write
waits; raised with F_SETPIPE_SZ up to /proc/sys/fs/pipe-max-size."""
PIPE_MAX_SIZE = "/proc/sys/fs/pipe-max-size"
FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW


@dataclass
class OutputPlan:
    """An attempt's log destinations: torchrun's layout (`dest`, from lay_out_attempt, which
    also sets each rank's TORCHELASTIC_ERROR_FILE) and the pipes of its redirected streams."""

    dest: AttemptLogs
    streams: list[RankStream]
    child_ends: dict[tuple[int, StreamName], int]
    """The write end each rank gets for a redirected stream (the daemon closes its copy once
    the ranks are started)."""

    def child_path(self, local_rank: int, name: StreamName) -> str:
        """What PContext should open for the rank's stream: torchrun's "" (inherit) or
        /dev/null, or the pipe's write end through /proc (opening it there opens the pipe)."""
        end = self.child_ends.get((local_rank, name))
        if end is not None:
            return f"/proc/self/fd/{end}"
        paths: dict[int, str] = self.dest.stdouts if name == "stdout" else self.dest.stderrs
        return paths[local_rank]

    def close_child_ends(self) -> None:
        for fd in self.child_ends.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.child_ends = {}

    def close(self) -> None:
        """Everything, when the ranks could not be started."""
        self.close_child_ends()
        for stream in self.streams:
            for fd in (stream.read_fd, stream.file_fd):
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.streams = []


def plan_output(spec: LaunchSpec) -> OutputPlan:
    """Blocking (runs in the spawning thread): the attempt's directories, log files and pipes."""
    dest = lay_out_attempt(
        spec.log_dir,
        spec.redirects,
        spec.tee,
        set(spec.local_ranks_filter) if spec.local_ranks_filter else None,
        spec.envs,
    )
    plan = OutputPlan(dest, [], {})
    try:
        for local_rank in sorted(spec.envs):
            prefix = (spec.log_line_prefixes or {}).get(local_rank, f"[{spec.name}{local_rank}]:")
            outputs: tuple[tuple[StreamName, dict[int, str], dict[int, str]], ...] = (
                ("stdout", dest.stdouts, dest.tee_stdouts),
                ("stderr", dest.stderrs, dest.tee_stderrs),
            )
            for name, paths, tees in outputs:
                path = paths[local_rank]
                if path in ("", os.devnull):
                    continue
                tee = tees.get(local_rank) == path
                _add_stream(plan, local_rank, name, path, tee, prefix.encode(errors="replace"))
    except BaseException:
        plan.close()
        raise
    return plan


def _add_stream(
    plan: OutputPlan, local_rank: int, name: StreamName, path: str, tee: bool, prefix: bytes
) -> None:
    file_fd = os.open(path, FILE_FLAGS, 0o666)
    try:
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    except BaseException:
        os.close(file_fd)
        raise
    os.set_blocking(read_fd, False)
    size = grow_pipe(write_fd)
    plan.child_ends[(local_rank, name)] = write_fd
    plan.streams.append(RankStream(local_rank, name, path, read_fd, file_fd, size, tee, prefix))


def grow_pipe(fd: int, wanted: int = PIPE_SIZE) -> int:
    """Raise the pipe's capacity towards `wanted` (within the system's limits); the capacity."""
    try:
        with open(PIPE_MAX_SIZE) as limit:
            allowed = int(limit.read())
    except (OSError, ValueError):
        allowed = wanted
    for size in (wanted, allowed):
        if size > 0 and size <= wanted:
            with contextlib.suppress(OSError):  # EPERM: over the user's pipe-user-pages
                return fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)
    return fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
