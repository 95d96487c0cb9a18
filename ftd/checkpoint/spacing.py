"""--checkpoint-every: what the daemon tells its ranks about which saves take a snapshot, and
what it knows that they cannot: how often this job fails.

The ranks choose (ftd_client/checkpoint/_spacing.py: each measures what a snapshot costs it);
the daemon gives them the policy and the job's mean time between failures so far, and says in
its status the interval they chose.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class SnapshotSpacing:
    def __init__(
        self,
        every: int | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every = every
        """A snapshot at the steps divisible by it; None: auto."""
        self._clock = clock
        self._started = clock()
        self.failures = 0
        self._intervals: dict[int, int] = {}

    def failed(self) -> None:
        """The job's attempt ended by a fault (a restart began)."""
        self.failures += 1

    def mtbf_s(self) -> float:
        """The job's mean time between failures so far: its run time over its failures plus
        one (before the first failure, the time it has run without one)."""
        return max(self._clock() - self._started, 0.0) / (self.failures + 1)

    def reported(self, rank: int, interval: int | None) -> None:
        if interval is not None:
            self._intervals[rank] = interval

    def reply(self) -> dict[str, Any]:
        """What a rank learns with each answer about its snapshots."""
        return {
            "every": "auto" if self.every is None else self.every,
            "mtbf_s": round(self.mtbf_s(), 3),
        }

    def view(self) -> dict[str, Any]:
        """The status' fields (openapi.yaml NodeCheckpoint)."""
        return {
            "every": "auto" if self.every is None else self.every,
            "interval_steps": max(self._intervals.values(), default=None),
            "mtbf_s": round(self.mtbf_s(), 3),
        }
