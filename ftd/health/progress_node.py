"""The node's training progress for the operator: how fast its slowest rank makes steps, and
the time lost to failures since the job began on this node.

Time lost is the wall time since the node's first attempt started its ranks minus the time its
ranks were making steps: an attempt makes steps from the first optimizer step any rank of the
node reported in it to the last one, and these spans add up over the attempts. What is lost
is therefore every start (processes, imports, the rendezvous, loading a checkpoint: until the
first step), the time from a failed attempt's last step to the next attempt's first (the
fault, its detection, the restart, a back-off) and, while a job runs, the time since its last
step. Steps repeated after resuming from an older checkpoint count as making steps: the ranks'
counts restart with each process, so ftd cannot tell a repeated step from a new one.

Pure apart from the clocks it is given (`now`, `wall`): the tests pass fake ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REPORT_LAG_S = 1.5
"""How late the daemon may learn of a step: three of a rank's report intervals (0.5 s)."""


@dataclass(frozen=True)
class RankPace:
    """What the node's view needs of one rank that reports progress now."""

    steps: int
    step_time_s: float | None
    """Median seconds per step (None before its second step)."""
    last_step_at: float | None


@dataclass
class NodeProgress:
    """The node's steps across attempts (the daemon's monotonic clock, `now`)."""

    began_at: float | None = None
    """When the first attempt's ranks were started (None before)."""
    made_before_s: float = 0.0
    """Time spent making steps in the attempts before this one."""
    first_step_at: float | None = None
    last_step_at: float | None = None
    steps: dict[int, int] = field(default_factory=dict)
    """This attempt's steps by local rank, kept after the rank's reports end."""
    stepped_before: bool = False
    """An earlier attempt made optimizer steps: a restart ends at the new ranks' first step."""

    def attempt(self, now: float) -> None:
        """A new attempt's ranks start: the previous attempt's span is added up."""
        if self.began_at is None:
            self.began_at = now
        self.made_before_s += self._span()
        self.stepped_before |= self.first_step_at is not None
        self.first_step_at = self.last_step_at = None
        self.steps = {}

    @property
    def attempt_made_steps(self) -> bool:
        """A rank of the current (or last) attempt made an optimizer step."""
        return self.first_step_at is not None

    def reported(self, local_rank: int, steps: int) -> None:
        self.steps[local_rank] = steps

    def stepped(self, at: float) -> None:
        """A rank of the node made a step at `at`."""
        if self.first_step_at is None or at < self.first_step_at:
            self.first_step_at = at
        if self.last_step_at is None or at > self.last_step_at:
            self.last_step_at = at

    def _span(self) -> float:
        if self.first_step_at is None or self.last_step_at is None:
            return 0.0
        return self.last_step_at - self.first_step_at

    def view(self, paces: list[RankPace], now: float, wall: float) -> dict[str, Any]:
        """The node's `progress` in GET /v1/status (docs/api.md says what each counts)."""
        making = self.made_before_s + self._span()
        elapsed = None if self.began_at is None else max(now - self.began_at, 0.0)
        return {
            "steps": min(self.steps.values()) if self.steps else None,
            "steps_per_s": round(steps_per_s(paces, now), 6),
            "making_steps_s": round(making, 3),
            "time_lost_s": None if elapsed is None else round(max(elapsed - making, 0.0), 3),
            "since": None if elapsed is None else round(wall - elapsed, 3),
        }


def steps_per_s(paces: list[RankPace], now: float) -> float:
    """The pace of the slowest rank (fewest steps, then the longest step time): one step per
    its median step time; once its last step is older than that and REPORT_LAG_S, one step
    per the time since its last step, so that a rank that stopped falls towards 0. 0 when no
    rank makes steps (before two of a rank's reports showed steps, between attempts, after
    the job)."""
    timed = [p for p in paces if p.step_time_s is not None and p.last_step_at is not None]
    if not timed:
        return 0.0
    slowest = min(timed, key=lambda p: (p.steps, -(p.step_time_s or 0.0)))
    assert slowest.step_time_s is not None and slowest.last_step_at is not None
    since_step = now - slowest.last_step_at
    stopped = since_step > slowest.step_time_s + REPORT_LAG_S
    period = since_step if stopped else slowest.step_time_s
    return 1.0 / period if period > 0 else 0.0
