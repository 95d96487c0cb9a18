"""The daemon's observable state and its one writer.

A change of state is logged, recorded as an event, written to `<run dir>/status.json`, and
published to the other nodes (for `GET /v1/cluster`) without waiting for the store. The files
are a convenience: the API reads the state from memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from ftd.config.serve import ServeConfig
from ftd.status.event_kind import EventKind
from ftd.status.events import EventLog
from ftd.status.model import (
    Connecting,
    DaemonState,
    Failure,
    NodeStatus,
    RankState,
    RankStatus,
    Standby,
    Waiting,
)
from ftd.status.persist import Persistence

log = logging.getLogger("ftd.daemon")


class NodeProgressView(Protocol):
    def node_view(self) -> dict[str, Any]:
        """The node's steps/s and time lost (ftd/health/progress_node.py)."""
        ...

    def deadlines_view(self) -> dict[str, Any]:
        """The progress deadlines in force (ftd/health/progress.py)."""
        ...


class LiveView(Protocol):
    """What the health service sees now, read at each snapshot (never copied into the status)."""

    def snapshot(self, pid: int | None) -> dict[str, Any] | None:
        """The live view of the rank with this pid, if watched."""
        ...

    def timeouts_view(self) -> dict[str, Any]: ...

    def ipc_view(self) -> dict[str, Any]:
        """The rank socket's counters: messages received, dropped by cause, ..."""
        ...

    @property
    def progress(self) -> NodeProgressView: ...


class StatusBoard:
    def __init__(
        self,
        config: ServeConfig,
        status: NodeStatus,
        events: EventLog,
        persist: Persistence,
        run_dir: Path,
        live: LiveView,
        publish: Callable[[dict[str, Any]], None] | None = None,
        checkpoint_view: Callable[[], dict[str, Any] | None] | None = None,
        summary_parts: Sequence[Callable[[], dict[str, Any]]] = (),
    ) -> None:
        """`summary_parts`: more of the published summary (the replicas' address, the
        stragglers' forward times, ...), each read as the summary is made."""
        self.config = config
        self.status = status
        self.events = events
        self.persist = persist
        self.run_dir = run_dir
        self._live = live
        self._checkpoint_view = checkpoint_view
        self.publish = publish
        """Sends this node's summary to the other nodes (fire and forget)."""
        self.group_rank: int | None = None
        self.round: int | None = None
        self._summary_parts = tuple(summary_parts)

    def set_state(self, state: DaemonState, reason: str = "", cause: str | None = None) -> None:
        """`cause`: the last failure's cause read again as the job ends, once every line the
        ranks wrote is in their files (ftd.supervision.summary.final_cause)."""
        status = self.status
        if cause is not None and status.last_failure is not None:
            status.last_failure.cause = cause
        if state is not status.state:
            log.info("state %s -> %s%s", status.state, state, f": {reason}" if reason else "")
            self.events.emit(
                EventKind.STATE_CHANGED,
                previous=status.state.value,
                state=state.value,
                reason=reason,
            )
            status.state = state
            if state is not DaemonState.RENDEZVOUS:
                how = f"the daemon is {state.value}" + (f": {reason}" if reason else "")
                self._standby_ended(how)
            if self.publish is not None:
                self.publish(self.summary())
        self.write()

    # -- every other change of the node status goes through one of these ---------------------

    def round_joined(self, number: int, group_rank: int, restarts: int) -> None:
        self.round, self.group_rank = number, group_rank
        self.status.restart_count = restarts
        self._standby_ended(f"joined round {number} as an active node (node rank {group_rank})")

    def standby(self, wait: Standby) -> None:
        """The coordinator found round `wait.round` full: this node waits for its end as a
        standby (again, for a later round, when the next one is full too)."""
        if self.status.standby is not None and self.status.standby.round == wait.round:
            return
        self.status.standby = wait
        self.write()
        log.info("%s", wait.reason)
        self.events.emit(
            EventKind.STANDBY, round=wait.round, members=wait.members, reason=wait.reason
        )
        if self.publish is not None:
            self.publish(self.summary())

    def waiting(self, wait: Waiting | None) -> None:
        """The node waits in a round for others to join, as last read (None: it closed)."""
        if wait != self.status.waiting:
            self.status.waiting = wait
            self.write()

    def connecting(self, reach: Connecting | None) -> None:
        """The node reaches for its rendezvous endpoint, as its last try went (None: done)."""
        if reach != self.status.connecting:
            self.status.connecting = reach
            self.write()

    def _standby_ended(self, how: str) -> None:
        """It waits as a standby no more: `how` (it joined a round, the job ended, ...)."""
        wait, self.status.standby = self.status.standby, None
        if wait is None:
            return
        self.write()
        log.info("standby of round %d ended: %s", wait.round, how)
        self.events.emit(
            EventKind.STANDBY_ENDED,
            round=wait.round,
            reason=how,
            waited_s=round(max(0.0, time.time() - wait.since), 3),
        )

    def restarts_counted(self, restarts: int) -> None:
        """The restarts the job has used, as the coordinator counted them."""
        self.status.restart_count = restarts

    def attempt_starting(self, number: int, ranks: list[RankStatus]) -> None:
        self.status.attempt, self.status.ranks = number, ranks

    def attempt_failed(self, failure: Failure, cause: str | None = None) -> None:
        """`cause`: what the job said of the failure (its exception, its last stderr lines),
        kept with it wherever it is shown: status.json, the API, the events, the summary."""
        if cause is not None:
            failure.cause = cause
        self.status.last_failure = failure

    def job_culprit(self, culprit: dict[str, Any]) -> None:
        """The job's culprit of the last hang, decided across nodes."""
        self.status.job_culprit = culprit
        self.write()

    def recovered(self, stages: dict[str, Any]) -> None:
        """The last restart's stages, once its ranks resumed."""
        self.status.last_recovery = stages

    def health_checked(self, unhealthy: str | None) -> None:
        """The node's health check before the rendezvous: why it sits out, or None."""
        if unhealthy != self.status.unhealthy:
            self.status.unhealthy = unhealthy
            self.write()

    def backing_off(self, delay_s: float, fast_failures: int = 0) -> None:
        """The wait before the next attempt (0: none), after `fast_failures` in a row."""
        status = self.status
        status.backoff_s, status.fast_failures = delay_s, fast_failures
        status.backoff_until = time.time() + delay_s if delay_s > 0 else None

    @staticmethod
    def rank_started(rank: RankStatus, pid: int) -> None:
        rank.pid, rank.state, rank.started_at = pid, RankState.RUNNING, time.time()
        rank.exit_code = rank.ended_at = None

    @staticmethod
    def rank_exited(rank: RankStatus, code: int, stopped: bool) -> None:
        """`stopped`: the daemon was stopping the ranks (a non-zero code is then no failure)."""
        rank.exit_code, rank.ended_at = code, time.time()
        if code == 0:
            rank.state = RankState.SUCCEEDED
        else:
            rank.state = RankState.STOPPED if stopped else RankState.FAILED

    def summary(self) -> dict[str, Any]:
        """What this node publishes for GET /v1/cluster on any node."""
        status, failure = self.status, self.status.last_failure
        summary = {
            "node_id": self.config.node_id,
            "state": status.state.value,
            "attempt": status.attempt,
            "restart_count": status.restart_count,
            "group_rank": self.group_rank,
            "round": self.round,
            "nproc_per_node": self.config.nproc_per_node,
            "ranks_running": sum(r.state is RankState.RUNNING for r in status.ranks),
            "ranks_total": len(status.ranks),
            "last_failure": failure.reason[:4000] if failure else None,
            "time": time.time(),
        }
        for part in self._summary_parts:
            summary.update(part())
        return summary

    def snapshot(self) -> dict[str, object]:
        """The node status with its live parts: status.json and `GET /v1/status`."""
        live = self._live
        snapshot = self.status.to_dict(
            live.snapshot, live.timeouts_view(), live.ipc_view(), live.progress.node_view()
        )
        snapshot["checkpoint"] = self._checkpoint_view() if self._checkpoint_view else None
        snapshot["progress_deadlines"] = live.progress.deadlines_view()
        return snapshot

    def write(self) -> None:
        self.persist.write_json(self.run_dir / "status.json", self.snapshot())

    def write_cluster(
        self, number: int | None, members: Sequence[str], excluded: dict[str, str], size: int
    ) -> None:
        """`<run dir>/cluster.json`: the last round and the excluded nodes as this node saw them
        (`members` empty where it holds no list: a large round, coordination/assignment.py)."""
        state = {"round": number, "members": list(members), "size": size, "excluded": excluded}
        self.persist.write_json(self.run_dir / "cluster.json", state)
