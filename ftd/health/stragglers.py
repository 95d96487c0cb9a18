"""Stragglers: a rank whose own work per step is persistently slower than its peers'.

In DDP every rank's step takes as long as the slowest rank's (they wait for each other in the
gradient allreduce), so step time cannot tell who is slow. Two parts of a step are the rank's
own, outside any collective wait, and each rank reports the median of its last 16
(ftd_client/progress.py); each is judged on its own (a `StragglerWatch` per signal):

- `forward`: the outermost module's training forward pass (`fwd_us`): the compute;
- `host`: the time from an optimizer step to the next forward, less the time inside
  torch.distributed calls (`host_us`): data loading and host-side work before the forward.
  A fast rank waits for a slow one inside backward (DDP's allreduce), not there.

A rank whose time stays above its peers' in either is the one the others wait for.

A rank is compared with the median of every *other* rank of the job (this node's and, through
the rendezvous store, the other nodes'): with two ranks the median of both would sit halfway and
halve the signal. It is slow while both hold:

- ratio >= SLOW_RATIO (1.2): a rank 20 % slower costs the whole job 20 % of its forward time,
  well outside the few percent two identical ranks differ by (the 16-step median already
  smooths single slow steps: a garbage collection, a page fault);
- excess >= MIN_EXCESS_S (10 ms): tiny models (tens of microseconds forward) differ by large
  ratios from scheduling noise alone; an OS timeslice is 1-4 ms, so 10 ms is never noise and
  always worth an operator's look.

It becomes a straggler once slow for SUSTAIN_S (10 s: twenty reports, a medians' worth of
steps of most jobs; a transient such as a data-loading hiccup or a checkpoint on one rank's
disk passes first), and stops being one once its ratio falls under CLEAR_RATIO (1.1, below the
threshold so that a rank hovering at it does not flap) or its excess under half the minimum, for
SUSTAIN_S again. Each change gives one event.

Pure apart from the clocks it is given (`now` monotonic, `wall` for `since`): the property
tests use fake ones.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

SLOW_RATIO = 1.2
CLEAR_RATIO = 1.1
MIN_EXCESS_S = 0.010
SUSTAIN_S = 10.0
MIN_MEDIAN_S = 1e-6
"""A median of zero (forward times round to whole microseconds) is taken as 1 us."""


Signal = Literal["forward", "host"]
SIGNALS: tuple[Signal, ...] = ("forward", "host")
WHAT = {
    "forward": "forward pass takes",
    "host": "time between steps outside its forward (data loading, host work) is",
}


@dataclass(frozen=True)
class Straggler:
    global_rank: int
    ratio: float
    """The rank's time (of `signal`) over the median of the job's other ranks."""
    since: float
    """Wall time since when it has been slow."""
    signal: Signal = "forward"

    def view(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "since": round(self.since, 3), "signal": self.signal}


@dataclass(frozen=True)
class StragglerChange:
    kind: Literal["straggler", "cleared"]
    straggler: Straggler
    seconds: float | None
    median_s: float | None
    reason: str


@dataclass(frozen=True)
class Comparison:
    seconds: float
    median_s: float

    @property
    def ratio(self) -> float:
        return round(self.seconds / max(self.median_s, MIN_MEDIAN_S), 3)

    @property
    def slow(self) -> bool:
        return self.ratio >= SLOW_RATIO and self.seconds - self.median_s >= MIN_EXCESS_S

    @property
    def recovered(self) -> bool:
        return self.ratio < CLEAR_RATIO or self.seconds - self.median_s < MIN_EXCESS_S / 2


def compare(rank: int, forward: Mapping[int, float]) -> Comparison | None:
    """`rank` against the median of the others in `forward` (None without others)."""
    others = [seconds for other, seconds in forward.items() if other != rank]
    if rank not in forward or not others:
        return None
    return Comparison(forward[rank], statistics.median(others))


class StragglerWatch:
    """This node's stragglers in one signal, judged against the whole job's times of it."""

    def __init__(self, signal: Signal = "forward") -> None:
        self.signal: Signal = signal
        self.stragglers: dict[int, Straggler] = {}
        self._slow_since: dict[int, tuple[float, float]] = {}
        """Rank -> when (monotonic, wall) it was first seen slow in its current stretch."""
        self._recovered_since: dict[int, float] = {}

    def check(
        self, now: float, wall: float, own: Mapping[int, float], peers: Mapping[int, float]
    ) -> list[StragglerChange]:
        """The changes, given this node's ranks' forward times (`own`, global rank ->
        seconds) and the other nodes' (`peers`; a rank in both is taken from `own`)."""
        forward = {**peers, **own}
        changes = []
        for rank in sorted(self.stragglers.keys() - own.keys()):
            gone = self.stragglers.pop(rank)
            self._recovered_since.pop(rank, None)
            changes.append(StragglerChange("cleared", gone, None, None, "the rank is gone"))
        for rank in self._slow_since.keys() - own.keys():
            del self._slow_since[rank]
        for rank in sorted(own):
            change = self._judge(rank, compare(rank, forward), now, wall)
            if change is not None:
                changes.append(change)
        return changes

    def _judge(
        self, rank: int, seen: Comparison | None, now: float, wall: float
    ) -> StragglerChange | None:
        current = self.stragglers.get(rank)
        if current is None:
            if seen is None or not seen.slow:
                self._slow_since.pop(rank, None)
                return None
            began, began_wall = self._slow_since.setdefault(rank, (now, wall))
            if now - began < SUSTAIN_S:
                return None
            del self._slow_since[rank]
            found = self.stragglers[rank] = Straggler(rank, seen.ratio, began_wall, self.signal)
            reason = (
                f"rank {rank}'s {WHAT[self.signal]} {seen.seconds * 1000:.1f} ms, "
                f"{seen.ratio:g}x the median of the job's other ranks "
                f"({seen.median_s * 1000:.1f} ms), for {now - began:.0f}s"
            )
            return StragglerChange("straggler", found, seen.seconds, seen.median_s, reason)
        if seen is None:
            return None  # nothing to compare with for now (the peers' view is refreshing)
        self.stragglers[rank] = Straggler(rank, seen.ratio, current.since, self.signal)
        if not seen.recovered:
            self._recovered_since.pop(rank, None)
            return None
        began = self._recovered_since.setdefault(rank, now)
        if now - began < SUSTAIN_S:
            return None
        del self._recovered_since[rank], self.stragglers[rank]
        reason = (
            f"rank {rank}'s {WHAT[self.signal]} {seen.seconds * 1000:.1f} ms, "
            f"{seen.ratio:g}x the median of the others, for {now - began:.0f}s"
        )
        cleared = Straggler(rank, seen.ratio, current.since, self.signal)
        return StragglerChange("cleared", cleared, seen.seconds, seen.median_s, reason)

    def view(self, global_rank: int) -> dict[str, Any] | None:
        straggler = self.stragglers.get(global_rank)
        return straggler.view() if straggler is not None else None

    def listed(self) -> list[dict[str, Any]]:
        """Every straggler of this node, for its published summary."""
        return [{"global_rank": r, **s.view()} for r, s in sorted(self.stragglers.items())]


class Stragglers:
    """This node's stragglers in every signal (SIGNALS), one watch each."""

    def __init__(self) -> None:
        self.watches = {signal: StragglerWatch(signal) for signal in SIGNALS}

    def check(
        self,
        now: float,
        wall: float,
        own: Mapping[Signal, Mapping[int, float]],
        peers: Mapping[Signal, Mapping[int, float]],
    ) -> list[StragglerChange]:
        """The changes of every signal, given this node's ranks' times and the other nodes'."""
        return [
            change
            for signal, watch in self.watches.items()
            for change in watch.check(now, wall, own.get(signal, {}), peers.get(signal, {}))
        ]

    def view(self, global_rank: int) -> dict[str, Any] | None:
        """The rank's straggler record: of the signal it is slowest in, relatively."""
        found = [
            w.stragglers[global_rank] for w in self.watches.values() if global_rank in w.stragglers
        ]
        return max(found, key=lambda s: s.ratio).view() if found else None

    def listed(self) -> list[dict[str, Any]]:
        """Every straggler of this node, for its published summary (a rank slow in both
        signals is listed once, by the signal it is slowest in)."""
        ranks = sorted({r for w in self.watches.values() for r in w.stragglers})
        return [{"global_rank": r, **view} for r in ranks if (view := self.view(r)) is not None]
