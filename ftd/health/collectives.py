"""What a node's ranks had entered as an attempt ended on a hang: its part of the job's culprit
(ftd/coordination/job_culprit.py decides across nodes). Frozen once per attempt, at the node's
own hang verdict (its culprit may be killed and forgotten before the attempt ends) or else as
the attempt's ranks are stopped."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from ftd.health.progress import ProgressWatch, RankProgress, sort_key


@dataclass(frozen=True)
class NodeCollectives:
    lowest: int
    """The fewest collectives a rank of the node had entered."""
    rank: int
    """That rank (global); of several, the one that stopped first."""
    since: float
    """When (wall time) it last made progress."""
    waiting: int
    """Ranks of the node that had entered more: they wait on it."""
    ranks: int
    judged: bool
    """The node's own verdict froze it."""


def of_ranks(ranks: Iterable[RankProgress], judged: bool, now: float) -> NodeCollectives | None:
    """The node's collectives from its ranks' progress (`now`: their clock); None where no
    rank reports the collectives it entered."""
    known = [p for p in ranks if p.entered is not None]
    if not known:
        return None
    first = min(known, key=sort_key)
    lowest = first.entered or 0
    return NodeCollectives(
        lowest=lowest,
        rank=first.rank.global_rank,
        since=max(time.time() - (now - first.advanced_at), 0.0),
        waiting=sum(1 for p in known if (p.entered or 0) > lowest),
        ranks=len(known),
        judged=judged,
    )


class AttemptCollectives:
    """The current attempt's NodeCollectives, frozen once."""

    def __init__(self, progress: ProgressWatch) -> None:
        self._progress = progress
        self.frozen: NodeCollectives | None = None
        self._done = False

    def new_attempt(self) -> None:
        self.frozen, self._done = None, False

    def freeze(self, judged: bool) -> None:
        """Taken now unless taken before in this attempt."""
        if not self._done:
            self._done = True
            self.frozen = of_ranks(self._progress.reported(), judged, time.monotonic())
