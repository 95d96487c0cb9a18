"""What the front ends (REST API, admin socket, dashboard, /metrics) may ask of a daemon:
reads and requests, answered.

Requests are checked here and handed to the part that owns the state: the running attempt, the
health service, the coordinator. Nothing here mutates state another part owns.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

from ftd.api.cluster_view import bounded
from ftd.api.kept_cluster import KeptClusterView
from ftd.config.serve import ServeConfig
from ftd.coordination import CoordinationError, Coordinator
from ftd.coordination.base import new_request
from ftd.errors import Conflict, FeatureUnavailable, Forbidden, NotFound
from ftd.health.service import HealthService
from ftd.status.event_kind import EventKind
from ftd.status.events import Event, EventLog
from ftd.status.model import DaemonState, Failure, NodeStatus
from ftd.supervision.attempt import Running
from ftd.tasks import Background

log = logging.getLogger("ftd.control")

RankFileName = Literal["stacks.txt", "stderr.log"]
"""The rank files the front ends may read (the daemon wrote where they are)."""


class NodeControl:
    """The daemon as the front ends see it."""

    def __init__(
        self,
        config: ServeConfig,
        status: NodeStatus,
        events: EventLog,
        run_dir: Path,
        running: Running,
        coordinator: Coordinator,
        health: HealthService,
        background: Background,
        summary: Callable[[], dict[str, Any]],
        snapshot: Callable[[], dict[str, object]],
    ) -> None:
        self.config = config
        self.status = status
        self.events = events
        self.run_dir = run_dir
        self._running = running
        self._coordinator = coordinator
        self._health = health
        self._background = background
        self._summary = summary
        """This node's summary, as the other nodes see it (the one-node cluster view)."""
        self.status_snapshot = snapshot
        self._cluster = KeptClusterView(coordinator.cluster, background)

    def request_restart(self, scope: str, reason: str, requested_by: str, count: bool) -> Event:
        """Ask for a restart of the workers; the `restart_requested` event. Conflict when the
        daemon is stopping or done."""
        attempt = self._running.attempt
        state = self.status.state
        if state.is_terminal or state is DaemonState.STOPPING:
            raise Conflict(f"the daemon is {state}: there is nothing to restart")
        if attempt is None or state is not DaemonState.RUNNING:
            raise Conflict(f"the daemon is {state}; retry once it is running")
        event = self.events.emit(
            EventKind.RESTART_REQUESTED, scope=scope, reason=reason, by=requested_by, counted=count
        )
        attempt.fail(
            Failure(
                kind="request",
                reason=f"restart requested by {requested_by}: {reason}",
                timestamp=event.time,
                counted=count,
            )
        )
        return event

    def inject_fault(self, kind: str, rank: int | None, delay_s: float, requested_by: str) -> Event:
        """Have rank `rank` (None: a random one of this node) carry out a `kill` or `hang` after
        `delay_s`. Forbidden unless --enable-fault-injection; Conflict unless running;
        NotFound for a rank that is not on this node."""
        if not self.config.enable_fault_injection:
            raise Forbidden("fault injection is off: start ftd serve with --enable-fault-injection")
        attempt = self._running.attempt
        if attempt is None or self.status.state is not DaemonState.RUNNING:
            raise Conflict(f"the daemon is {self.status.state}; faults go to running ranks")
        by_global = {status.global_rank: status for status in self.status.ranks}
        if rank is None:
            rank = random.choice(sorted(by_global))
        target = by_global.get(rank)
        if target is None or target.pid is None:
            raise NotFound(f"rank {rank} does not run on node {self.config.node_id}")
        event = self.events.emit(
            EventKind.FAULT_REQUESTED, kind=kind, global_rank=rank, delay_s=delay_s, by=requested_by
        )
        attempt.inject_fault(target.local_rank, target.pid, kind, delay_s)
        return event

    def rank_file(self, global_rank: int, attempt: int | None, name: RankFileName) -> Path:
        """The path of one of this node's ranks' files (`stacks.txt`, `stderr.log`) in an
        attempt's log directory (None: the current attempt), built from the daemon's own
        records only. NotFound for a rank that is not on this node or an attempt not run."""
        current = self.status.attempt
        if attempt is None:
            attempt = current
        if not 0 <= attempt <= current:
            raise NotFound(f"no attempt {attempt} on node {self.config.node_id} (0 to {current})")
        local = {rank.global_rank: rank.local_rank for rank in self.status.ranks}.get(global_rank)
        if local is None:
            raise NotFound(f"rank {global_rank} does not run on node {self.config.node_id}")
        return self.run_dir / f"attempt_{attempt}" / str(local) / name

    def cluster(self, offset: int, limit: int) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        """A page of every node's summary, the current round's membership, the excluded nodes,
        the aggregates over them (cluster_view.py; a coroutine where they are read from the
        rendezvous store, kept_cluster.py), the job's culprit of the last hang as this node
        learned it."""
        coordinator = self._coordinator
        if self.config.multi_node and coordinator.reached and not coordinator.lost.is_set():
            rnd = coordinator.round
            return self._with_culprit(
                self._cluster.page(rnd.number if rnd else None, offset, limit)
            )
        summary = self._summary()
        view = {
            "nodes": [{**summary, "role": "active"}],
            "round": {"round": self.status.attempt, "members": [self.config.node_id]},
            "excluded": [],
            "stragglers": [
                {"node_id": self.config.node_id, **s} for s in summary.get("stragglers", ())
            ],
        }
        return {**bounded(view, offset, limit), "culprit": self.status.job_culprit}

    async def _with_culprit(self, page: Awaitable[dict[str, Any]]) -> dict[str, Any]:
        return {**(await page), "culprit": self.status.job_culprit}

    def get_timeouts(self) -> dict[str, Any]:
        """The rank-health timeouts in force. FeatureUnavailable until they exist."""
        return self._health.timeouts.model_dump()

    def set_timeouts(self, patch: dict[str, Any], requested_by: str) -> dict[str, Any]:
        """Apply a partial update (validated; InvalidRequest naming the field); the new values."""
        return self._health.update(patch, by=requested_by).model_dump()

    async def exclude_node(self, node_id: str, reason: str, requested_by: str) -> Event:
        """Exclude a node from the job. NotFound, Conflict (below MIN) or FeatureUnavailable."""
        if not self.config.multi_node:
            if node_id != self.config.node_id:
                raise NotFound(f"no node {node_id!r} in this job")
            raise FeatureUnavailable(
                "node exclusion needs the multi-node rendezvous: start ftd serve with "
                "--nnodes MIN:MAX (MAX > 1)"
            )
        rnd = self._running.round
        members: tuple[str, ...] = (self.config.node_id,)
        if rnd is not None:
            try:
                members = await self._coordinator.roster(rnd)
            except CoordinationError as error:
                why = f"cannot read the round's members now: {error.reason}"
                raise Conflict(why) from None
        if node_id not in members:
            listed = ", ".join(members[:20]) + (
                f" and {len(members) - 20} more" if len(members) > 20 else ""
            )
            raise NotFound(f"no node {node_id!r} in the current round ({listed})")
        if node_id in self._coordinator.excluded:
            raise Conflict(f"node {node_id!r} is already excluded")
        if len(members) - 1 < self.config.nnodes_min:
            raise Conflict(
                f"excluding {node_id!r} would leave {len(members) - 1} nodes, below the minimum "
                f"of {self.config.nnodes_min}"
            )
        event = self.events.emit(
            EventKind.NODE_EXCLUDED, node_id=node_id, reason=reason, by=requested_by
        )
        why = f"node {node_id} excluded by {requested_by}" + (f": {reason}" if reason else "")
        self._background.spawn(self._exclude(node_id, why), f"exclude-{node_id}")
        return event

    async def _exclude(self, node_id: str, why: str) -> None:
        coordinator = self._coordinator
        try:
            await coordinator.exclude(node_id, why)
            self._cluster.drop()
            rnd = self._running.round
            if rnd is not None:
                await coordinator.request(rnd, new_request("restart", why, self.config.node_id))
        except CoordinationError as error:
            log.error("could not exclude node %s: %s", node_id, error.reason)

    def readmit_node(self, node_id: str, requested_by: str) -> Event:
        """Re-admit an excluded node. NotFound when it is not excluded."""
        if not self.config.multi_node or not self._coordinator.readmitting(node_id):
            raise NotFound(f"node {node_id!r} is not excluded")
        event = self.events.emit(EventKind.NODE_READMITTED, node_id=node_id, by=requested_by)
        self._background.spawn(self._readmit(node_id), f"readmit-{node_id}")
        return event

    async def _readmit(self, node_id: str) -> None:
        try:
            await self._coordinator.readmit(node_id)
            self._cluster.drop()
        except CoordinationError as error:
            log.error("could not readmit node %s: %s", node_id, error.reason)
