"""Hot spares, seen (both backends): a node that finds a round full waits for its end as a
standby (shared_rounds.late_request), and says so: to its own board (its status, the
`standby` event, the `ftd_node_standby` gauge) through the hook its join was given, and to the
other nodes through a record in the store that their cluster views read, bounded:

  c10d   r<N>/standby (a counter) and r<N>/standby/<k>: the k-th standby of round N (keys
         cannot be listed); a view reads the first MAX_STANDBYS_READ slots
  etcd   r<N>/standby/<node>, held by the standby's lease; a view lists MAX_STANDBYS_READ

Each is a StandbyRecord, decoded like every record (records.py): an invalid one is skipped and
counted. A node in the round's members is active whatever a record says.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from ftd.coordination.base import Round, RoundWaits
from ftd.coordination.records import NodeId, Record
from ftd.coordination.shared_rounds import Late
from ftd.status.model import Standby

log = logging.getLogger("ftd.rendezvous")

MAX_STANDBYS_READ = 64
"""Standbys a cluster view shows for one round (a job keeps a few spares, not hundreds)."""


class StandbyRecord(Record):
    """A node waiting for round N's end as a standby, since `since` (time.time())."""

    node_id: NodeId
    since: float = Field(ge=0, allow_inf_nan=False)


@dataclass(frozen=True)
class ClusterView:
    """The round a cluster view shows: the one this node is in, or a newer one it waits for
    as a standby (`standby`: this node is one of its standbys)."""

    number: int | None
    members: tuple[str, ...]
    me: str
    standby: bool


def viewed_round(
    rnd: Round | None, members: Sequence[str], standing_by: Late | None, me: str
) -> ClusterView:
    """`members`: `rnd`'s (the coordinator's roster)."""
    if standing_by is not None and (rnd is None or standing_by.number > rnd.number):
        members = tuple(standing_by.record.node_ids())
        return ClusterView(standing_by.number, members, me, standby=True)
    if rnd is None:
        return ClusterView(None, (), me, standby=False)
    return ClusterView(rnd.number, tuple(members), me, standby=False)


def cluster_nodes(
    summaries: Mapping[str, dict[str, Any]], view: ClusterView, standbys: Collection[str]
) -> list[dict[str, Any]]:
    """Every member's summary (role `active`), every standby's (`standby`) and this node's,
    by node id; `state: unknown` where a node published none (or none that verified)."""
    spares = {*standbys, *([view.me] if view.standby else [])} - set(view.members)
    names = sorted({*view.members, *spares, view.me})
    return [
        {
            **summaries.get(name, {"node_id": name, "state": "unknown"}),
            "role": "standby" if name in spares else "active",
        }
        for name in names
    ]


async def stand_by(
    late: Late,
    waits: RoundWaits | None,
    register: Callable[[float], Awaitable[object]],
) -> None:
    """This node waits for round `late.number`'s end as a standby: its board hears it, then it
    registers (`register(since)`) where the other nodes' views find it. The registration is
    for the views alone: when it fails, the wait goes on (the view lacks this node)."""
    since = time.time()
    if waits is not None:
        waits.standby(Standby(round=late.number, members=len(late.record.members), since=since))
    try:
        await register(since)
    except Exception as error:  # the store's own loss is seen by the wait that follows
        log.info("could not register as a standby of round %d: %s", late.number, error)
