"""What the nodes of a job share through the rendezvous without each reading every other (issue
43): the round's node rank 0 reads every node's summary and writes what the others need of them
once, as a named aggregate (records.AGGREGATES); every other node reads that one record, and at
most the summary of the one node it deals with. A look then costs a node O(1) reads, and the job
O(N), where every node reading every summary cost O(N²).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ftd.coordination.base import Coordinator, Round


class JobShare:
    def __init__(self, coordinator: Coordinator, reachable: Callable[[], bool]) -> None:
        """`reachable`: whether the rendezvous is there to read (reached, not lost)."""
        self._coordinator = coordinator
        self._reachable = reachable

    @property
    def round(self) -> Round | None:
        """The current round, while the rendezvous can be read; else None."""
        return self._coordinator.round if self._reachable() else None

    def leading(self) -> bool:
        """Whether this node gathers (the round's node rank 0)."""
        rnd = self.round
        return rnd is not None and rnd.group_rank == 0

    async def every_summary(self) -> list[dict[str, Any]]:
        """Every member's summary (node rank 0's look; a replacement node's, once, to pull)."""
        if not self._reachable():
            return []
        nodes = (await self._coordinator.cluster()).get("nodes")
        return [node for node in nodes if isinstance(node, dict)] if isinstance(nodes, list) else []

    async def publish(self, name: str, values: dict[str, Any]) -> None:
        if self._reachable():
            await self._coordinator.publish_aggregate(name, values)

    async def read(self, name: str) -> dict[str, Any] | None:
        """The aggregate `name` of the current round (None: none written for it yet)."""
        rnd = self.round
        if rnd is None:
            return None
        found = await self._coordinator.aggregate(name)
        return found if found is not None and found.get("round") == rnd.number else None

    async def summary_of(self, node_id: str) -> dict[str, Any] | None:
        return await self._coordinator.summary_of(node_id) if self._reachable() else None
