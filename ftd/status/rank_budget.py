"""What a rank's messages may add to the event log: a token bucket per rank (issue 39 item 4).

A rank can say anything as often as it likes; the events its messages cause (a restore, a
workload request, changed timeouts, a simulated fault, a refused snapshot) are recorded within
its budget, and past it counted, not recorded (EventLog.emit_for_rank), so that no rank can
wipe the ring or grow events.jsonl.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

RANK_EVENTS_BURST = 200
RANK_EVENTS_PER_S = 20.0
"""What a rank's messages may add to the log: RANK_EVENTS_BURST events at once, then this many
a second (a token bucket per rank). A job's real rank events (a restore, a workload request,
changed timeouts) come a few per attempt."""
RANK_EVENTS_BUDGET = "events"


class RankBudget:
    """A token bucket per rank: whether an event a rank's message causes may be recorded."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tokens: dict[int, tuple[float, float]] = {}
        """rank -> (tokens left, when counted)."""
        self.refused: collections.Counter[int] = collections.Counter()
        self._refusing: set[int] = set()

    def counts(self) -> dict[str, int]:
        """The events refused, as a budget's refusals (`ipc.budget_refusals`)."""
        refused = self.refused.total()
        return {RANK_EVENTS_BUDGET: refused} if refused else {}

    def take(self, rank: int) -> bool | None:
        """True: record it; False: refuse it; None: refuse it, the first of an episode."""
        now = self._clock()
        tokens, then = self._tokens.get(rank, (float(RANK_EVENTS_BURST), now))
        tokens = min(RANK_EVENTS_BURST, tokens + (now - then) * RANK_EVENTS_PER_S)
        if tokens >= 1.0:
            self._tokens[rank] = (tokens - 1.0, now)
            if tokens >= RANK_EVENTS_BURST:  # refilled: a later flood is said again
                self._refusing.discard(rank)
            return True
        self._tokens[rank] = (tokens, now)
        self.refused[rank] += 1
        if rank in self._refusing:
            return False
        self._refusing.add(rank)
        return None
