"""The daemon's observable state: what `/v1/status` and the event log show."""

from __future__ import annotations

import enum
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ftd.config.restart import RestartPolicy


class DaemonState(enum.StrEnum):
    """Lifecycle of a node daemon.

    INIT -> RENDEZVOUS -> RUNNING -> (RESTARTING -> RENDEZVOUS -> RUNNING)* -> terminal.
    Any non-terminal state -> STOPPING on a termination signal, or while the ranks are
    stopped at the job's end.
    Terminal: SUCCEEDED (every rank exited 0), FAILED (restarts used up, or a fatal reason),
    STOPPED (ended by a signal or an operator).
    """

    INIT = "init"
    RENDEZVOUS = "rendezvous"
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def is_terminal(self) -> bool:
        return self in (DaemonState.SUCCEEDED, DaemonState.FAILED, DaemonState.STOPPED)


class RankState(enum.StrEnum):
    """STARTING -> RUNNING -> SUCCEEDED | FAILED | STOPPED (killed by the daemon)."""

    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


def describe_exit(code: int) -> str:
    """`exit code 1` or `signal SIGKILL (9)`, from a Popen-style status."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name} ({-code})"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


@dataclass
class RankStatus:
    """One local rank of the current attempt; written by its WorkerGroup only."""

    local_rank: int
    global_rank: int
    pid: int | None = None
    state: RankState = RankState.STARTING
    exit_code: int | None = None
    started_at: float | None = None
    """Wall-clock time (time.time()) the process was started."""
    ended_at: float | None = None

    def to_dict(self, health: dict[str, Any] | None = None) -> dict[str, object]:
        """With `health`, the health service's live view of the rank (heartbeat age, section)."""
        health = health or {}
        return {
            "local_rank": self.local_rank,
            "global_rank": self.global_rank,
            "pid": self.pid,
            "state": self.state.value,
            "exit_code": self.exit_code,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "last_heartbeat_age_s": health.get("last_heartbeat_age_s"),
            "section": health.get("section"),
            "section_age_s": health.get("section_age_s"),
            "dropped_messages": health.get("dropped_messages"),
            "progress": health.get("progress"),
        }


@dataclass
class Failure:
    """Why an attempt ended badly; `reason` is the same sentence logs and the API show."""

    kind: str
    """`exit`, `signal`, `hang`, `start` (the ranks could not be started), `request` or
    `fatal`."""
    reason: str
    local_rank: int | None = None
    global_rank: int | None = None
    pid: int | None = None
    exit_code: int | None = None
    error_file: str | None = None
    timestamp: float = 0.0
    counted: bool = True
    """Whether the restart it causes counts against --max-restarts."""
    origin: float | None = None
    """When the fault began as far as the daemon can tell, if before `timestamp` (a hung
    rank's last sign of life)."""
    cause: str | None = None
    """What the job said of it: the exception its error file names (`FileNotFoundError:
    ...`), else the last lines of its captured stderr, else that it died before writing an
    error file; escaped and bounded (ftd.supervision.summary.failure_cause). Set by the
    board."""

    def to_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "reason": self.reason,
            "local_rank": self.local_rank,
            "global_rank": self.global_rank,
            "pid": self.pid,
            "exit_code": self.exit_code,
            "error_file": self.error_file,
            "timestamp": self.timestamp,
            "counted": self.counted,
            "origin": self.origin,
            "cause": self.cause,
        }


@dataclass(frozen=True)
class Standby:
    """This node waits as a hot spare: round `round` was full (`members` nodes) when it came,
    so it waits for that round's end, and takes the place of a node the round lost."""

    round: int
    members: int
    since: float
    """When it began to wait (time.time())."""

    @property
    def reason(self) -> str:
        return (
            f"standby: round {self.round} is full ({self.members} nodes), waiting to take a "
            "lost node's place"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "round": self.round,
            "members": self.members,
            "since": self.since,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class Waiting:
    """This node waits in round `round` for others to join (as the rendezvous last read it):
    who joined, who of the round before is not back, and when the join timeout ends it."""

    round: int
    endpoint: str
    joined: tuple[str, ...]
    missing: tuple[str, ...]
    """The previous round's members not back yet."""
    nnodes_min: int
    nnodes_max: int
    gives_up_at: float
    """When the join timeout ends the wait (time.time())."""
    joined_count: int | None = None
    """How many joined (`joined` names them while at most 64 did, none past that:
    shared_rounds.JOINED_NAMES_MAX); None: as many as it names."""

    def to_dict(self) -> dict[str, object]:
        return {
            "round": self.round,
            "endpoint": self.endpoint,
            "joined": list(self.joined),
            "joined_count": len(self.joined) if self.joined_count is None else self.joined_count,
            "missing": list(self.missing),
            "nnodes_min": self.nnodes_min,
            "nnodes_max": self.nnodes_max,
            "left_s": round(max(0.0, self.gives_up_at - time.time()), 3),
        }


@dataclass(frozen=True)
class Connecting:
    """This node reaches for its rendezvous endpoint (before any round): since when, how many
    tries failed, the last one's error, and when the join timeout ends the attempt."""

    endpoint: str
    since: float
    """When it began (time.time())."""
    gives_up_at: float
    """When the join timeout ends it (time.time())."""
    tries: int = 0
    """Tries that failed so far."""
    last_error: str | None = None
    """The last try's error (one line, bounded); None before a try failed."""

    def to_dict(self) -> dict[str, object]:
        return {
            "endpoint": self.endpoint,
            "since": self.since,
            "tries": self.tries,
            "last_error": self.last_error,
            "left_s": round(max(0.0, self.gives_up_at - time.time()), 3),
        }


@dataclass
class NodeStatus:
    node_id: str
    run_id: str
    state: DaemonState = DaemonState.INIT
    attempt: int = 0
    restart_count: int = 0
    max_restarts: int = 0
    restart_policy: RestartPolicy = RestartPolicy.ANY_FAILED
    ranks: list[RankStatus] = field(default_factory=list)
    last_failure: Failure | None = None
    last_recovery: dict[str, Any] | None = None
    """The last restart's stages (recovery.py), once its ranks resumed."""
    backoff_s: float = 0.0
    """The delay before the next attempt after attempts that failed fast (crash loop)."""
    backoff_until: float | None = None
    """When that wait ends (time.time()); None when there is none."""
    fast_failures: int = 0
    """Attempts in a row that failed fast (the back-off's count)."""
    unhealthy: str | None = None
    """Why the node sits out of the rendezvous (its health check failed); None when healthy."""
    standby: Standby | None = None
    """Set while the node waits as a standby (a hot spare) for a full round's end."""
    waiting: Waiting | None = None
    """Set while the node waits in a round for others to join; None once it closed."""
    connecting: Connecting | None = None
    """Set while the node reaches for its rendezvous endpoint; None once it did (or gave up)."""
    job_culprit: dict[str, Any] | None = None
    """The job's culprit of the last hang, as decided across nodes (JobCulprit and `victim`)."""

    def to_dict(
        self,
        rank_view: Callable[[int | None], dict[str, Any] | None] | None = None,
        timeouts: dict[str, Any] | None = None,
        ipc: dict[str, Any] | None = None,
        progress: dict[str, Any] | None = None,
    ) -> dict[str, object]:
        """With the live parts the health service sees (StatusBoard.snapshot): each rank's
        view by pid, the timeouts in force, the rank socket's counters and the node's
        progress."""
        health = rank_view or (lambda pid: None)
        return {
            "node_id": self.node_id,
            "run_id": self.run_id,
            "state": self.state.value,
            "attempt": self.attempt,
            "restart_count": self.restart_count,
            "max_restarts": self.max_restarts,
            "restart_policy": self.restart_policy.value,
            "timeouts": timeouts or {},
            "ipc": ipc or {},
            "ranks": [rank.to_dict(health(rank.pid)) for rank in self.ranks],
            "last_failure": self.last_failure.to_dict() if self.last_failure else None,
            "last_recovery": self.last_recovery,
            "backoff_s": self.backoff_s,
            "backoff_left_s": (
                None
                if self.backoff_until is None
                else round(max(0.0, self.backoff_until - time.time()), 3)
            ),
            "fast_failures": self.fast_failures,
            "unhealthy": self.unhealthy,
            "standby": self.standby.to_dict() if self.standby is not None else None,
            "waiting": self.waiting.to_dict() if self.waiting is not None else None,
            "connecting": self.connecting.to_dict() if self.connecting is not None else None,
            "progress": progress,
            "job_culprit": self.job_culprit,
        }
