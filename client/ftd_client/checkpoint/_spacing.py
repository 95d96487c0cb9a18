"""Which saves take a snapshot: every step's (the default), every N-th, or as many as pay off.

A snapshot costs the training its copy (on a node with no idle core, the copy's CPU is taken
from the steps), and a failure costs the steps done since the newest snapshot. Which is more
depends on how often the job fails: `ftd serve --checkpoint-every auto` takes a snapshot every k
steps with k from Young and Daly's interval √(2·C·M) (C: what one snapshot costs, M: the job's
mean time between failures, from the daemon), which minimises the sum of the two.

Every rank of a job must hold the same steps (load restores one that all hold), so k is a power
of two and a snapshot is taken at the steps divisible by k (or, where the script saves only
some steps, at the first save past each multiple): ranks whose k differ for a while (each
measures its own C) still share every step divisible by the largest. The steps
--checkpoint-persist writes are always taken.
"""

from __future__ import annotations

import math
import time
from typing import Any

MAX_EVERY = 1 << 20
"""The longest interval, in steps (a rank reports its interval to the daemon: protocol.py)."""
MAX_AUTO_EVERY = 1024
SMOOTHING = 0.2
"""The weight of the newest measurement in the moving averages of C and of the step time."""


class Spacing:
    def __init__(self) -> None:
        self.fixed: int | None = 1
        """--checkpoint-every N; None for auto."""
        self.persist_every: int | None = None
        self.mtbf_s: float | None = None
        self.cost_s: float | None = None
        """C: what a snapshot cost the training (the copy's CPU time and save's own time)."""
        self.step_s: float | None = None
        self._last: tuple[int, float] | None = None

    def learn(self, reply: dict[str, Any]) -> None:
        """The daemon's policy, as its replies say it (absent or malformed: kept as it was)."""
        every = reply.get("every")
        if every == "auto":
            self.fixed = None
        elif isinstance(every, int) and not isinstance(every, bool) and 1 <= every <= MAX_EVERY:
            self.fixed = every
        mtbf = reply.get("mtbf_s")
        if isinstance(mtbf, int | float) and not isinstance(mtbf, bool) and 0 < mtbf < 1e12:
            self.mtbf_s = float(mtbf)
        persist = reply.get("persist_every")
        if isinstance(persist, int) and not isinstance(persist, bool) and persist >= 1:
            self.persist_every = persist

    def due(self, step: int) -> bool:
        """Whether the save of `step` takes a snapshot (called once per save, in order): the
        first save of the process, and then each that reaches a multiple of the interval (in a
        script that saves every step: the steps divisible by it)."""
        now, last = time.perf_counter(), self._last
        self._last = (step, now)
        if last is not None and step > last[0]:
            self.step_s = _average(self.step_s, (now - last[1]) / (step - last[0]))
        if self.persist_every is not None and step % self.persist_every == 0:
            return True
        every = self.interval()
        return last is None or step // every > last[0] // every

    def spent(self, seconds: float) -> None:
        """A snapshot was taken and cost the training `seconds`."""
        self.cost_s = _average(self.cost_s, max(seconds, 0.0))

    def interval(self) -> int:
        if self.fixed is not None:
            return self.fixed
        return auto_interval(self.cost_s, self.mtbf_s, self.step_s)


def auto_interval(cost_s: float | None, mtbf_s: float | None, step_s: float | None) -> int:
    """Young/Daly's interval in steps, as a power of two (the nearest in log scale), 1 ..
    MAX_AUTO_EVERY; 1 while any of the three is unknown."""
    if not cost_s or not mtbf_s or not step_s or step_s <= 0:
        return 1
    steps = math.sqrt(2.0 * cost_s * mtbf_s) / step_s
    if not math.isfinite(steps) or steps <= 1.0:
        return 1
    return min(1 << round(math.log2(steps)), MAX_AUTO_EVERY)


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)
