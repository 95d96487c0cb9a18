"""What a node does when the coordinator says another node was lost: the policy decides whether
the round goes on (min-healthy, enough nodes left) or ends with a restart request."""

from __future__ import annotations

import logging

from ftd.config.serve import ServeConfig
from ftd.coordination import Coordinator, Round
from ftd.coordination.base import new_request
from ftd.status.event_kind import EventKind
from ftd.status.events import EventLog
from ftd.supervision.attempt import Running
from ftd.supervision.policy import Action, after_node_lost, counts_healthy_nodes
from ftd.tasks import Background

log = logging.getLogger("ftd.daemon")


class NodeLoss:
    """The coordinator's word that a node was lost (its liveness): said, then acted on for the
    round running, if any, in the background."""

    def __init__(
        self,
        config: ServeConfig,
        coordinator: Coordinator,
        events: EventLog,
        background: Background,
        running: Running,
    ) -> None:
        self._config = config
        self._coordinator = coordinator
        self._events = events
        self._background = background
        self._running = running

    def on_node_lost(self, node_id: str, reason: str) -> None:
        self._events.emit(EventKind.NODE_LOST, node_id=node_id, reason=reason)
        self._background.spawn(self._ask(node_id, reason), f"node-lost-{node_id}")

    async def _ask(self, node_id: str, reason: str) -> None:
        rnd = self._running.round
        if rnd is not None:
            await ask_after_node_lost(self._coordinator, self._config, rnd, node_id, reason)


async def ask_after_node_lost(
    coordinator: Coordinator, config: ServeConfig, rnd: Round, node_id: str, reason: str
) -> None:
    """Round `rnd` lost `node_id`: request its restart unless the policy lets it go on."""
    healthy = rnd.size - 1
    if counts_healthy_nodes(config.restart_policy):
        healthy = await coordinator.unhealthy(rnd, node_id)
    decision = after_node_lost(reason, config.restart_policy, healthy, config.nnodes_min)
    if decision.action is Action.CONTINUE:
        log.warning("%s", decision.reason)
        return
    await coordinator.request(rnd, new_request("restart", reason, config.node_id))
    if not counts_healthy_nodes(config.restart_policy):
        # Marked once the round's end is decided (never before: a mark lets the others'
        # success end it): the next round gives a lost node no last call, a standby takes
        # its place at once.
        await coordinator.unhealthy(rnd, node_id)
