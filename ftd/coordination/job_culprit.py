"""The job's culprit of a hang, decided from every node's collectives (issue 43).

A node judges only its own ranks: in a job of many nodes every rank stops at the collective the
hung one never entered, and each node that judges names the rank of its own that is behind. The
job's culprit is the rank all the others wait on: c10d numbers the collectives alike on every
rank, so it is the one that entered the fewest, on whichever node it runs; where no collective
tells the nodes apart, the one that stopped first. Each node shares what its ranks had entered
as the attempt ended (`Collectives`, one record per node and round); the round's node rank 0
decides once (`JobCulprit`, the first valid record in force) and every node reads the decision
with one blocking wait: O(N) operations per hang in all, none while the job runs.

Pure: `decide` takes the records and the wall clock; the tests give it made-up ones.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ftd.coordination.records import Collectives, JobCulprit

GATHER_QUIET_S = 1.0
"""Node rank 0 waits for the nodes' collectives until none came for this long: a node that has
not shared by then (gone, or still stopping its ranks) is decided without. While they keep
coming (a loaded store: at 1,024 nodes on one machine etcd took 2.7 s for every node's) it
waits on, up to GATHER_MAX_S."""
GATHER_MAX_S = 4.0
DECISION_WAIT_S = 10.0
"""How long a node waits for the decision once it shared its collectives (node rank 0 decides
at most GATHER_MAX_S after it shared its own, which may be after this node's)."""


def gather_wait_s(since: float, last_news: float, now: float) -> float:
    """How much longer node rank 0 waits, at `now`, for collectives not come yet: until
    GATHER_QUIET_S after the last that came (`last_news`; `since` before any came), never past
    GATHER_MAX_S after it began to wait (`since`). 0: decide now."""
    return max(0.0, min(last_news + GATHER_QUIET_S, since + GATHER_MAX_S) - now)


def decide(number: int, found: Iterable[Collectives], now: float) -> JobCulprit | None:
    """Round `number`'s culprit from the nodes' collectives (None: no node's ranks reported
    the collectives they entered)."""
    known = [c for c in found if c.round == number and c.lowest is not None and c.rank is not None]
    if not known:
        return None

    def order(c: Collectives) -> tuple[int, float, int]:
        return (c.lowest or 0, c.since if c.since is not None else math.inf, c.group_rank)

    culprit = min(known, key=order)
    entered = culprit.lowest or 0
    waiting = sum(1 for c in known if (c.lowest or 0) > entered)
    tied = sum(1 for c in known if c is not culprit and c.lowest == entered)
    where = f"node {culprit.node_id} rank {culprit.rank}"
    if waiting:
        why = (
            f"{where} is the job's culprit: it entered {entered} collectives, ranks of "
            f"{waiting} other node{'s' if waiting != 1 else ''} entered more and wait on it"
        )
        if tied:
            why += f"; ranks of {tied} more stopped at {entered} too, after it"
    elif tied:
        why = (
            f"{where} is the job's culprit: no collective tells the {len(known)} nodes apart "
            f"(each entered {entered}); it stopped first"
        )
    else:
        why = f"{where} is the job's culprit: it entered {entered} collectives"
        if culprit.waiting:
            why += f", {culprit.waiting} rank(s) of its node entered more and wait on it"
    assert culprit.rank is not None
    return JobCulprit(
        round=number,
        node_id=culprit.node_id,
        group_rank=culprit.group_rank,
        rank=culprit.rank,
        entered=entered,
        waiting_nodes=waiting,
        nodes=len(known),
        reason=why,
        time=max(now, 0.0),
    )
