"""When every rank of an attempt took its first step: the end of a restart.

A rank's first step is its first optimizer step where an earlier attempt made some (its
progress report says so), else its first sign of life (a heartbeat, a section, `resumed()`).
"""

from __future__ import annotations

import asyncio
import time

from ftd.health.progress_node import NodeProgress


class FirstSteps:
    def __init__(self, node: NodeProgress) -> None:
        self._node = node
        self._all_stepped: asyncio.Future[float | None] | None = None
        self._not_stepped: set[int] = set()
        self._attempt: object = None

    def attach(self, attempt: object, local_ranks: set[int]) -> None:
        """A new attempt's ranks (`attempt`: its worker group): none has stepped yet."""
        self._attempt = attempt
        self._all_stepped = asyncio.get_running_loop().create_future()
        self._not_stepped = set(local_ranks)

    def detach(self) -> None:
        """The attempt ended: whoever waits is told it never stepped whole."""
        if self._all_stepped is not None and not self._all_stepped.done():
            self._all_stepped.set_result(None)

    async def wait(self, attempt: object) -> float | None:
        """When (wall clock) every rank of `attempt` stepped; None: it ended first."""
        if attempt is not self._attempt or self._all_stepped is None:
            return None
        return await asyncio.shield(self._all_stepped)

    def waiting_for(self, local_rank: int) -> bool:
        return local_rank in self._not_stepped

    def stepped(self, local_rank: int, at: float, step: bool = False) -> None:
        """`local_rank` showed life (`step`: made an optimizer step) at `at` (monotonic)."""
        if not step and self._node.stepped_before:  # a sign of life is no step
            return
        self._not_stepped.discard(local_rank)
        stepped = self._all_stepped
        if not self._not_stepped and stepped is not None and not stepped.done():
            stepped.set_result(time.time() - (time.monotonic() - at))
