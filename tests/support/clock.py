"""A fake clock for the health monitor: timers fire when the test advances time, in order, or
late and all at once when the process "did not run"."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from ftd.health.links import RankHealth


@dataclass(order=True)
class _Timer:
    when: float
    seq: int
    callback: Callable[[RankHealth], None] = field(compare=False)
    rank: RankHealth = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0
        self._heap: list[_Timer] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self.t

    def call_later(
        self, delay: float, callback: Callable[[RankHealth], None], rank: RankHealth
    ) -> _Timer:
        timer = _Timer(self.t + delay, next(self._seq), callback, rank)
        heapq.heappush(self._heap, timer)
        return timer

    def advance_to(self, target: float) -> None:
        """Timers fire on time, in order."""
        while self._heap and self._heap[0].when <= target:
            timer = heapq.heappop(self._heap)
            if not timer.cancelled:
                self.t = max(self.t, timer.when)
                timer.callback(timer.rank)
        self.t = max(self.t, target)

    def stall_to(self, target: float) -> None:
        """The process did not run until `target`: due timers fire late, all at once."""
        self.t = target
        self.advance_to(target)
