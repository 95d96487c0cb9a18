"""A restart, stage by stage: how long detection, stopping, the crash-loop back-off, rendezvous,
spawning and the ranks' first step took. Marks are wall-clock seconds; the stages add up to
fault → resumed."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any

STAGES = ("detect", "stop", "backoff", "rendezvous", "spawn", "first_step")


@dataclass
class Recovery:
    cause: str
    origin: float
    """When the fault began, as far as this daemon can tell: a rank's exit, a hung rank's last
    sign of life, a request's arrival."""
    decided: float
    """When the daemon knew the attempt had to end (exit seen, hang judged, request read)."""
    stopped: float | None = None
    backed_off: float | None = None
    """The crash-loop back-off (--restart-backoff) was over (at once when there was none):
    its wait is not the rendezvous's."""
    rendezvous: float | None = None
    """The next round closed: the placement is known."""
    spawned: float | None = None
    resumed: float | None = None
    """Every rank of the next attempt took its first step (heartbeat, section or resumed())."""

    def stages(self) -> dict[str, float | None]:
        backed_off = self.backed_off
        if backed_off is None and self.stopped is not None and self.rendezvous is not None:
            backed_off = self.stopped  # no back-off marked (a round ended elsewhere): none
        marks = [self.origin, self.decided, self.stopped, backed_off, self.rendezvous]
        marks += [self.spawned, self.resumed]
        return {
            name: round(end - start, 6) if start is not None and end is not None else None
            for name, (start, end) in zip(STAGES, pairwise(marks), strict=True)
        }

    def event_data(self, attempt: int) -> dict[str, Any]:
        end = self.resumed
        return {
            "attempt": attempt,
            "round": attempt,
            "cause": self.cause,
            "stages": self.stages(),
            "total_s": round(end - self.origin, 6) if end is not None else None,
            "failure_time": self.origin,
        }
