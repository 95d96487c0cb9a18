"""The daemon's observable state and its one writer.

A change of state is logged, recorded as an event, written to `<run dir>/status.json`, and
published to the other nodes (for `GET /v1/cluster`) without waiting for the store. The files
are a convenience: the API reads the state from memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftd.config.serve import ServeConfig
from ftd.status.event_kind import EventKind
from ftd.status.events import EventLog
from ftd.status.model import DaemonState, NodeStatus, RankState
from ftd.status.persist import Persistence

log = logging.getLogger("ftd.daemon")


class StatusBoard:
    def __init__(
        self,
        config: ServeConfig,
        status: NodeStatus,
        events: EventLog,
        persist: Persistence,
        run_dir: Path,
    ) -> None:
        self.config = config
        self.status = status
        self.events = events
        self.persist = persist
        self.run_dir = run_dir
        self.publish: Callable[[dict[str, Any]], None] | None = None
        """Sends this node's summary to the other nodes (fire and forget)."""
        self.group_rank: int | None = None
        self.round: int | None = None

    def set_state(self, state: DaemonState, reason: str = "") -> None:
        status = self.status
        if state is not status.state:
            log.info("state %s -> %s%s", status.state, state, f": {reason}" if reason else "")
            self.events.emit(
                EventKind.STATE_CHANGED,
                previous=status.state.value,
                state=state.value,
                reason=reason,
            )
            status.state = state
            if self.publish is not None:
                self.publish(self.summary())
        self.write()

    def summary(self) -> dict[str, Any]:
        """What this node publishes for GET /v1/cluster on any node."""
        status, failure = self.status, self.status.last_failure
        return {
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

    def write(self) -> None:
        self.persist.write_json(self.run_dir / "status.json", self.status.to_dict())

    def write_cluster(
        self, number: int | None, members: list[str], excluded: dict[str, str]
    ) -> None:
        """`<run dir>/cluster.json`: the last round and the excluded nodes as this node saw them."""
        state = {"round": number, "members": members, "excluded": excluded}
        self.persist.write_json(self.run_dir / "cluster.json", state)
