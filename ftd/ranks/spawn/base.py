"""The start-method interface: the supervisor sees `StartedGroup`s and nothing else."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Literal, Protocol

StreamName = Literal["stdout", "stderr"]


@dataclass
class RankStream:
    """One redirected stream of one rank: the daemon's ends of it."""

    local_rank: int
    name: StreamName
    path: str
    """The log file (stdout.log, stderr.log)."""
    read_fd: int
    """The pipe's read end, non-blocking; the daemon's to read and close."""
    file_fd: int
    """The log file, opened by the daemon; closed by the writer that owns it."""
    pipe_size: int
    tee: bool
    """Also to the daemon's own stdout/stderr, each line after `prefix` (torchrun's --tee)."""
    prefix: bytes


@dataclass(frozen=True)
class LaunchSpec:
    """One attempt of a node's worker group, fully resolved."""

    name: str
    cmd: tuple[str, ...]
    """argv before the per-rank arguments: interpreter, flags and script (or the binary)."""
    envs: dict[int, dict[str, str]]
    log_dir: str
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: frozenset[int] | None = None
    log_line_prefixes: dict[int, str] | None = field(default=None)
    python: bool = False
    """cmd is launch.build_command's `python -u [-m] target args` (not --no-python's binary)."""

    @property
    def nprocs(self) -> int:
        return len(self.envs)


@dataclass(frozen=True)
class RankHandle:
    local_rank: int
    pid: int
    error_file: str
    stdout: str
    stderr: str


class StartedGroup(Protocol):
    """A running attempt's processes. Every method is non-blocking unless it says otherwise."""

    ranks: dict[int, RankHandle]
    attempt_log_dir: str
    streams: list[RankStream]
    """The daemon's ends of the ranks' redirected stdout/stderr (pipes and their log files),
    for ftd.ranks.output to read and close."""

    def reap(self, local_rank: int) -> int | None:
        """The rank's exit status (negative: killed by that signal), or None while it runs."""
        ...

    def kill(self, local_rank: int, sig: signal.Signals) -> None:
        """Signal the rank's whole process group; a group already gone is not an error."""
        ...

    def close(self) -> None:
        """Blocking: release logs and tail threads once every process has exited."""
        ...


class Spawner(Protocol):
    name: str

    def prepare(self) -> None:
        """Blocking: be ready to start ranks at once (the zygote's preload); never raises (a
        start method that cannot get ready says so when `start` falls back)."""
        ...

    def start(self, spec: LaunchSpec) -> StartedGroup:
        """Blocking: start every rank of the attempt (run it in a thread)."""
        ...

    def close(self) -> None:
        """Blocking: release what the start method keeps across attempts (once, at shutdown)."""
        ...
