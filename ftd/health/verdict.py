"""What the monitor is built on and what it hands out: its clock, and hang verdicts.

The clock is the event loop in the daemon and a fake one in tests; a verdict lists the ranks
found hung together, the one silent longest first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ftd.health.links import Cancellable, Deadline, RankHealth


class Clock(Protocol):
    """Monotonic time and timers: the event loop in the daemon, a fake clock in tests."""

    def now(self) -> float: ...

    def call_later(
        self, delay: float, callback: Callable[[RankHealth], None], rank: RankHealth
    ) -> Cancellable: ...


class LoopClock:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def now(self) -> float:
        return time.monotonic()

    def call_later(
        self, delay: float, callback: Callable[[RankHealth], None], rank: RankHealth
    ) -> Cancellable:
        return self._loop.call_later(delay, callback, rank)


@dataclass(frozen=True)
class Overdue:
    rank: RankHealth
    deadline: Deadline

    def reason(self, now: float) -> str:
        return self.deadline.reason(self.rank, now)


@dataclass(frozen=True)
class Verdict:
    """Ranks found hung together, the one silent longest first."""

    overdue: tuple[Overdue, ...]
    at: float

    @property
    def first(self) -> Overdue:
        return self.overdue[0]


def order_by_silence(overdue: list[Overdue]) -> list[Overdue]:
    """The rank whose last sign of life is oldest stopped first: it comes first (a rank waiting
    on it in a collective stopped talking later); ties by global rank."""

    def silent_since(item: Overdue) -> float:
        rank = item.rank
        seen = rank.last_seen if rank.last_seen is not None else rank.connected_at
        return seen if seen is not None else float("-inf")

    return sorted(overdue, key=lambda item: (silent_since(item), item.rank.global_rank))
