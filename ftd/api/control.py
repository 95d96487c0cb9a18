"""What the REST API (and other front ends) may ask of a daemon: reads and requests, never
direct mutation of state the daemon's loop owns."""

from __future__ import annotations

from collections.abc import Awaitable
from pathlib import Path
from typing import Any, Protocol

from ftd.config.serve import ServeConfig
from ftd.status.events import Event, EventLog
from ftd.status.model import NodeStatus


class DaemonControl(Protocol):
    config: ServeConfig
    status: NodeStatus
    events: EventLog
    run_dir: Path

    def status_snapshot(self) -> dict[str, object]:
        """The node status with its live parts (rank health, timeouts, socket counters)."""
        ...

    def request_restart(self, scope: str, reason: str, requested_by: str, count: bool) -> Event:
        """Ask for a restart of the workers; the `restart_requested` event. Conflict when the
        daemon is stopping or done."""
        ...

    def cluster(self) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        """Every node's summary, the current round's membership, the excluded nodes (a
        coroutine where they are read from the rendezvous store)."""
        ...

    def get_timeouts(self) -> dict[str, Any]:
        """The rank-health timeouts in force. FeatureUnavailable until they exist."""
        ...

    def set_timeouts(self, patch: dict[str, Any], requested_by: str) -> dict[str, Any]:
        """Apply a partial update (validated; InvalidRequest naming the field); the new values."""
        ...

    def inject_fault(self, kind: str, rank: int | None, delay_s: float, requested_by: str) -> Event:
        """Have rank `rank` (None: a random one of this node) carry out a `kill` or `hang` after
        `delay_s`. Forbidden unless --enable-fault-injection; Conflict unless running;
        NotFound for a rank that is not on this node."""
        ...

    def exclude_node(self, node_id: str, reason: str, requested_by: str) -> Event:
        """Exclude a node from the job. NotFound, Conflict (below MIN) or FeatureUnavailable."""
        ...

    def readmit_node(self, node_id: str, requested_by: str) -> Event:
        """Re-admit an excluded node. NotFound when it is not excluded."""
        ...
