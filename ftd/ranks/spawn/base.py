"""The start-method interface: the supervisor sees `StartedGroup`s and nothing else."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ftd.ranks.spawn.output import RankStream


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


def get_spawner(name: str, preload: Sequence[str] = ()) -> Spawner:
    """The start method called `name`; `preload` names modules the zygote imports besides
    torch (other start methods ignore it)."""
    from ftd.ranks.spawn.pcontext import PContextSpawner
    from ftd.ranks.spawn.zygote import ZygoteSpawner

    if name == "zygote":
        return ZygoteSpawner(preload)

    spawners: dict[str, type[Spawner]] = {"subprocess": PContextSpawner}
    # torchrun's --start-method names choose how *functions* start; a script is always a
    # subprocess under torchrun, so they all map to the subprocess start method.
    for alias in ("spawn", "fork", "forkserver"):
        spawners[alias] = PContextSpawner
    try:
        return spawners[name]()
    except KeyError:
        raise ValueError(
            f"start_method: unknown {name!r}; choose from {sorted([*spawners, 'zygote'])}"
        ) from None
