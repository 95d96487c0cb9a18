"""Hang verdicts from what the ranks observed of their own progress, and the culprit of a hang.

Every rank ftd starts reports its progress without the script's help (ftd_client/progress.py:
optimizer steps, collectives entered on the default group and Python collective calls
entered/returned, open automatic sections such as `torch.save`). Any change of those counts is
progress. Once a rank of the node has made an optimizer step, a rank that makes none for the
job's progress deadline is hung (timed from that first step at the earliest: set-up is not
judged, and a rank whose set-up was as long as its peers' reports its own first step up to a
sampler interval later than they do): the deadline is learned, PROGRESS_FACTOR times the longest
interval between two progress events seen in this job (never below the floor,
`--progress-timeout-floor`); a rank inside an automatic section is judged by that section's
deadline instead (learned from the durations it was seen to take, AUTO_SECTION_DEFAULT_S
before it ever ended).

The culprit: of ranks stuck in one job, the others have entered a collective it has not
(c10d numbers them alike on every rank), so the rank with the fewest collectives entered stopped
the others; they are its victims. Ties (no collective tells them apart) go to the rank that
stopped first. The same order names the culprit of a heartbeat or section verdict where the
ranks report progress (HangHandler): who went silent first is a coin toss between a rank that
stopped and the ranks that block on it a millisecond later.

Pure apart from the clock it is given (`now` arguments): the property tests use a fake one.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ftd_client.messages import ProgressReport
from ftd_client.protocol import MAX_SECTIONS

from ftd.health.links import RankHealth
from ftd.health.progress_node import NodeProgress, RankPace
from ftd.health.stragglers import SIGNALS, Signal, Stragglers
from ftd.health.sync import BudgetExceeded

PROGRESS_FACTOR = 3.0
"""The deadline is this many times the longest interval between progress events seen."""
AUTO_FACTOR = 3.0
"""An automatic section's deadline: this many times the longest it was seen to take."""
AUTO_SECTION_DEFAULT_S = 1800.0
"""An automatic section never seen to end (a first checkpoint, a DataLoader's first workers)
is given NCCL's default collective timeout: a slow disk is no hang."""
DEFAULT_FLOOR_S = 300.0
"""`--progress-timeout-floor`'s default: longer than a rank-0-only evaluation or a logging
pause of most jobs (learning only raises it), far shorter than the 10-30 min a collective
waits before its own timeout."""
STALLED_AFTER_S = 1.5
"""A rank without progress this long is stalled (three of its sampler's intervals): a victim
when another is judged."""
STEP_WINDOW = 32
AUTO_NAMES = "auto_section_names"
"""The budget of the automatic-section names whose durations a node learns: MAX_SECTIONS, as
for the script's own sections (a name past it is timed by AUTO_SECTION_DEFAULT_S)."""


@dataclass
class RankProgress:
    """What one rank last reported, and when its counts last changed (daemon clock)."""

    rank: RankHealth
    link: int
    """The connection that carries the rank's reports (forgotten when it closes)."""
    counts: tuple[int, int | None, int, int]
    """steps, collectives entered, Python collective calls entered, returned."""
    auto: dict[str, float]
    """Open automatic sections -> when each opened."""
    advanced_at: float
    sampled_at: float
    last_step_at: float | None = None
    own_s: dict[Signal, float] = field(default_factory=dict)
    """The rank's median time per step of each straggler signal (stragglers.py)."""
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))

    @property
    def steps(self) -> int:
        return self.counts[0]

    @property
    def entered(self) -> int | None:
        return self.counts[1]

    def view(self, now: float) -> dict[str, Any]:
        steps, entered, called, returned = self.counts
        return {
            "steps": steps,
            "last_step_age_s": (
                round(now - self.last_step_at, 3) if self.last_step_at is not None else None
            ),
            "step_time_s": round(statistics.median(self.step_times), 6)
            if self.step_times
            else None,
            "forward_s": self.own_s.get("forward"),
            "host_s": self.own_s.get("host"),
            "collectives_entered": entered,
            "collective_calls": called,
            "collective_calls_returned": returned,
            "progress_age_s": round(now - self.advanced_at, 3),
            "automatic_section": next(iter(self.auto), None),
        }


@dataclass(frozen=True)
class ProgressVerdict:
    culprit: RankProgress
    victims: tuple[RankProgress, ...]
    reason: str
    at: float


def in_a_section(rank: RankHealth) -> bool:
    """Whether `rank` is inside a section of its script's, timed or not."""
    return bool(rank.open_sections)


def sort_key(progress: RankProgress) -> tuple[bool, int, float, int]:
    """The culprit first: fewest collectives entered, then stopped first, then global rank."""
    entered = progress.entered
    return (entered is None, entered or 0, progress.advanced_at, progress.rank.global_rank)


class ProgressWatch:
    """The node's ranks' progress in the current attempt, and the verdicts it leads to."""

    def __init__(self, floor_s: float = DEFAULT_FLOOR_S, enabled: bool = True) -> None:
        self.floor_s = floor_s
        self.enabled = enabled
        """False (`--progress off`): reports are kept for status, never judged."""
        self._ranks: dict[int, RankProgress] = {}
        self._ended: dict[int, RankProgress] = {}  # a rank that exited: see reported()
        self._longest_interval = 0.0
        self._auto_longest: dict[str, float] = {}
        self._judged = False
        self.stragglers = Stragglers()
        """Judged by the straggler timer (ftd/health/straggler_timer.py), shown in `view`."""
        self.node = NodeProgress()
        """The node's steps across attempts: steps/s and time lost (progress_node.py)."""
        self._armed_at: float | None = None
        """When the attempt's first optimizer step was reported: no rank is timed from earlier."""

    def attach(self, now: float | None = None) -> None:
        """A new attempt: its ranks start afresh (what was learned stays: the same job)."""
        self._ranks, self._ended, self._judged = {}, {}, False
        self.node.attempt(time.monotonic() if now is None else now)
        self._armed_at = None

    @property
    def armed(self) -> bool:
        """Judging starts with the node's first optimizer step (set-up is not progress)."""
        return self._armed_at is not None

    @property
    def deadline_s(self) -> float:
        return max(self.floor_s, PROGRESS_FACTOR * self._longest_interval)

    def auto_deadline_s(self, name: str) -> float:
        longest = self._auto_longest.get(name)
        if longest is None:
            return max(self.floor_s, AUTO_SECTION_DEFAULT_S)
        return max(self.floor_s, AUTO_FACTOR * longest)

    # -- reports -----------------------------------------------------------------------------

    def observe(
        self, rank: RankHealth, link: int, report: ProgressReport, at: float
    ) -> BudgetExceeded | None:
        """A rank's report sampled at `at` (daemon clock); the refusal of what it asked the
        node to learn past a budget (the rest is taken)."""
        counts = (report.steps, report.entered, report.called, report.returned)
        previous = self._ranks.get(rank.local_rank)
        if previous is None or previous.rank is not rank:
            previous = self._ranks[rank.local_rank] = RankProgress(
                rank, link, (0, None, 0, 0), {}, advanced_at=at, sampled_at=at
            )
        auto = {name: previous.auto.get(name, at - ms / 1000) for name, ms in report.auto}
        changed = counts != previous.counts or auto.keys() != previous.auto.keys()
        refused = None
        for name, opened in previous.auto.items():
            if name not in auto:  # it ended: how long it took teaches its deadline
                took = max(at - opened, 0.0)
                if name in self._auto_longest or len(self._auto_longest) < MAX_SECTIONS:
                    self._auto_longest[name] = max(self._auto_longest.get(name, 0.0), took)
                else:
                    refused = BudgetExceeded(AUTO_NAMES, f"more than {MAX_SECTIONS} names")
                # The ranks that waited for this one (in a barrier, a collective) are timed
                # from now: their reports of moving on may come up to a report later.
                for other in self._ranks.values():
                    other.advanced_at = max(other.advanced_at, at)
        if changed:
            if previous.steps > 0 and not previous.auto and not auto:
                interval = at - previous.advanced_at
                self._longest_interval = max(self._longest_interval, interval)
            self._steps_advanced(previous, report, at)
            previous.advanced_at = at
        previous.counts, previous.auto, previous.sampled_at = counts, auto, at
        self.node.reported(rank.local_rank, counts[0])
        if self._armed_at is None and counts[0] > 0:
            self._armed_at = at
        previous.link = link
        medians: tuple[tuple[Signal, int | None], ...] = (
            ("forward", report.fwd_us),
            ("host", report.host_us),
        )
        for signal, median_us in medians:
            if median_us is not None:
                previous.own_s[signal] = median_us / 1e6
        return refused

    def _steps_advanced(self, entry: RankProgress, report: ProgressReport, at: float) -> None:
        last_step_at = at if report.age_ms is None else at - report.age_ms / 1000
        steps = report.steps
        made = steps - entry.steps
        if made > 0 and entry.last_step_at is not None:
            entry.step_times.append(max(last_step_at - entry.last_step_at, 0.0) / made)
        if made > 0 or (entry.last_step_at is None and steps > 0):
            entry.last_step_at = last_step_at
            self.node.stepped(last_step_at)

    def forget(self, rank: RankHealth, link: int) -> None:
        """The connection that carried this rank's reports closed: the rank ended (or its
        observer did), so it stops no one."""
        entry = self._ranks.get(rank.local_rank)
        if entry is not None and entry.rank is rank and entry.link == link:
            self._ended[rank.local_rank] = self._ranks.pop(rank.local_rank)

    def paused(self, lost_s: float) -> None:
        """The daemon did not run for `lost_s` (a stall): no rank is blamed for that time."""
        if self._armed_at is not None:
            self._armed_at += lost_s
        for entry in self._ranks.values():
            entry.advanced_at += lost_s
            entry.auto = {name: opened + lost_s for name, opened in entry.auto.items()}

    # -- verdicts ----------------------------------------------------------------------------

    def judged(self) -> None:
        """The verdict `check` gave is carried out: no other in this attempt."""
        self._judged = True

    def check(
        self, now: float, section_timed: Callable[[RankHealth], bool] = in_a_section
    ) -> ProgressVerdict | None:
        """A verdict when the culprit among the stalled ranks is past its deadline (until one
        is `judged`). `section_timed`: whether a rank is inside a section of its script's that
        has a timeout in force (the monitor's: then that timeout judges it, not progress)."""
        if not self.enabled or self._judged or not self.armed:
            return None
        stalled = sorted(self._stalled(now), key=sort_key)
        if not stalled:
            return None
        culprit, victims = stalled[0], tuple(stalled[1:])
        if section_timed(culprit.rank):  # the script's own timed section (ftd_client, NVRx)
            return None  # wins: the monitor judges it by that section's timeout
        since, limit, what = self._limit(culprit)
        if now - since < limit:
            return None
        return ProgressVerdict(culprit, victims, _reason(culprit, victims, now - since, what), now)

    def next_due(self) -> float | None:
        """The earliest time (this clock) a verdict could be due, were no rank to report
        progress before it: each rank's stalled time and its deadline from when it was last
        seen to move; None when nothing is judged (off, judged, or before the first step)."""
        if not self.enabled or self._judged or not self.armed:
            return None
        dues = []
        for progress in self._ranks.values():
            since, limit, _ = self._limit(progress)
            dues.append(max(since + limit, self._since(progress.advanced_at) + STALLED_AFTER_S))
        return min(dues, default=None)

    def reporting(self) -> list[RankProgress]:
        """The ranks that report their progress now."""
        return list(self._ranks.values())

    def reported(self) -> list[RankProgress]:
        """reporting() and this attempt's ranks that exited, as they last reported: a rank
        blocked on a killed peer may exit before its node's share is taken (collectives.py)."""
        return list({**self._ended, **self._ranks}.values())

    def stalled_ranks(self, now: float) -> list[RankHealth]:
        """The ranks without progress for a while, culprit first."""
        return [p.rank for p in sorted(self._stalled(now), key=sort_key)]

    def _stalled(self, now: float) -> Iterable[RankProgress]:
        return (
            p for p in self._ranks.values() if now - self._since(p.advanced_at) >= STALLED_AFTER_S
        )

    def _since(self, at: float) -> float:
        """`at`, or the first step's report where that came later (set-up is never judged)."""
        return at if self._armed_at is None else max(at, self._armed_at)

    def in_force(self, progress: RankProgress) -> tuple[str, float, float]:
        """The deadline that judges the rank now: its name ("progress", or the automatic
        section's it is inside), its seconds, and since when (this clock) it is timed."""
        if progress.auto:
            name, opened = min(progress.auto.items(), key=lambda item: item[1])
            return name, self.auto_deadline_s(name), self._since(opened)
        return "progress", self.deadline_s, self._since(progress.advanced_at)

    def _limit(self, progress: RankProgress) -> tuple[float, float, str]:
        """Since when the rank is timed, its limit, and what the limit is."""
        name, limit, since = self.in_force(progress)
        if progress.auto:
            return since, limit, f"inside {name} (its deadline {limit:g}s)"
        learned = "learned" if limit > self.floor_s else "the floor"
        return since, limit, f"progress deadline {limit:g}s, {learned}"

    def culprit(self, candidates: Iterable[RankHealth], now: float) -> RankHealth | None:
        """Of ranks found hung together (a heartbeat or section verdict) and any stalled with
        them, the one that stopped the others, where progress tells: None where it does not."""
        known = {id(p.rank): p for p in self._ranks.values()}
        suspects = {id(p.rank): p for p in self._stalled(now)}
        for rank in candidates:
            if id(rank) not in known:
                return None
            suspects[id(rank)] = known[id(rank)]
        ordered = sorted(suspects.values(), key=sort_key)
        if len(ordered) < 2 or any(p.entered is None for p in ordered):
            return None
        first, second = ordered[0], ordered[1]
        return first.rank if first.entered != second.entered else None

    def blame(self, culprit: RankHealth, others: list[RankHealth]) -> str:
        """Why `culprit` (as `culprit` chose it) stopped `others`."""
        entered = {id(p.rank): p.entered for p in self._ranks.values()}
        waiting = [rank.global_rank for rank in others]
        return (
            f"rank {culprit.global_rank} is the culprit: it entered "
            f"{entered.get(id(culprit))} collectives, ranks {waiting} entered "
            f"{[entered.get(id(rank)) for rank in others]} and wait on it"
        )

    def view(self, rank: RankHealth, now: float) -> dict[str, Any] | None:
        progress = self._ranks.get(rank.local_rank)
        if progress is None or progress.rank is not rank:
            return None
        name, limit, since = self.in_force(progress)
        return {
            **progress.view(now),
            # What the operator needs to see a hang coming: null where no verdict can fire
            # (--progress off; the age also before the node's first step: set-up is not timed).
            "progress_deadline_s": limit if self.enabled else None,
            "progress_deadline_name": name if self.enabled else None,
            "progress_deadline_age_s": (
                round(max(now - since, 0.0), 3) if self.enabled and self.armed else None
            ),
            "straggler": self.stragglers.view(rank.global_rank),
        }

    def times(self) -> dict[Signal, dict[int, float]]:
        """Each straggler signal -> global rank -> median seconds, of the ranks that report it."""
        ranks = self._ranks.values()
        return {s: {p.rank.global_rank: p.own_s[s] for p in ranks if s in p.own_s} for s in SIGNALS}

    def node_view(self, now: float | None = None, wall: float | None = None) -> dict[str, Any]:
        """The node's `progress` in GET /v1/status: its slowest rank's steps and steps/s, the
        time spent making steps and the time lost since the job began here."""
        paces = [
            RankPace(
                p.steps, statistics.median(p.step_times) if p.step_times else None, p.last_step_at
            )
            for p in self._ranks.values()
        ]
        now = time.monotonic() if now is None else now
        return self.node.view(paces, now, time.time() if wall is None else wall)

    def deadlines_view(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "floor_s": self.floor_s,
            "deadline_s": self.deadline_s,
            "automatic_sections_s": {
                name: self.auto_deadline_s(name) for name in sorted(self._auto_longest)
            },
        }


def _reason(
    culprit: RankProgress, victims: tuple[RankProgress, ...], silent: float, what: str
) -> str:
    rank = culprit.rank.global_rank
    entered = culprit.entered
    reason = f"rank {rank} made no progress for {silent:.3f}s ({what}; {culprit.steps} steps"
    reason += f", {entered} collectives entered)" if entered is not None else ")"
    waiting = [v.rank.global_rank for v in victims if (v.entered or 0) > (entered or 0)]
    if entered is not None and waiting:
        reason += (
            f": the culprit, it has not entered collective {entered + 1}, which ranks "
            f"{waiting} entered and wait in"
        )
    others = [v.rank.global_rank for v in victims if v.rank.global_rank not in waiting]
    if others:
        reason += f"; ranks {others} stalled with it"
    return reason
