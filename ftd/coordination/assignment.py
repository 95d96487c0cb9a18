"""A closed round as one member needs it (issue 43): its place, node rank 0's address, its
replicas' successor, the budget and the excluded nodes; ~300 bytes whatever the job's size.

Every member reading the closing record, N members long, was b N² bytes a round from the one
store (b 3-7 packed: 115 MB at 4,096 nodes, 1.8 GB at 16,384; bench/SCALE.md). The closer
computes every member's place anyway, so after deciding the closing record it writes one
`Assignment` per joiner it read, at `r<N>/assign/<node>`: each member reads its own, and the
job pays O(N). The closing record stays the truth: node rank 0 (it watches every member), a
joiner the round left out, a late node, a standby, every node of a short round (LIST_MAX) and
the cluster view read it whole, as does a member whose assignment does not come within the
grace (its closer lost between the two writes, or this node joined as the round closed) or
does not verify. On etcd a short round's record rides in the close's mark (ClosedMark).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from ftd.config.serve import RDZV_LIST_MAX
from ftd.coordination.base import Round, ring_successor
from ftd.coordination.records import (
    MAX_NODES,
    Count,
    MemberRow,
    NodeId,
    Reason,
    Record,
    RecordCodec,
    RoundMember,
    RoundNumber,
    RoundRecord,
)

ASSIGN = "assign/"
"""Under the round: `r<N>/assign/<node>`."""
ASSIGNING = "assigning"
"""etcd: `r<N>/assigning`, the ClosedMark written with the closing record, which a joiner
awaits beside its assignment (a watch on the record itself would send each joiner its N
members)."""
ASSIGN_GRACE_S = 5.0
"""How long a joiner waits for its assignment once its round closed before it reads the closing
record (c10d: the closer writes them right after the record, one operation; etcd: this past
the closer's call timeout, etcd/assigned.py)."""
MAX_ASSIGNMENT_BYTES = 64 * 1024
LIST_MAX = RDZV_LIST_MAX
"""By default (`--rdzv-conf list_max=N`), a round of at most this many members is read whole by
each (its record under 4 KiB, its list in every node's events, logs and cluster.json, as
operators of small jobs expect): the assignments of such a round have no place."""
ETCD_BATCH = 100
"""Assignments per etcd transaction (below etcd's default --max-txn-ops, 128)."""

Rank = Annotated[int, Field(ge=0, lt=2**31)]


class Place(Record):
    """Where a member's ranks sit in its round's world."""

    group_rank: Annotated[int, Field(ge=0, lt=MAX_NODES)]
    size: Annotated[int, Field(ge=1, le=MAX_NODES)]
    base_global_rank: Rank
    world_size: Annotated[int, Field(ge=1, lt=2**31)]
    leader: MemberRow
    """Node rank 0's row: where the workers' store listens, whom liveness watches."""
    successor: NodeId | None = None
    """The next member in the replicas' ring (node ids in order), None alone."""


class ClosedMark(Record):
    """etcd's `r<N>/assigning`, written in the close's transaction: a copy of the closing
    record where the round is short or aborted (each joiner takes it from this event, as it
    took the record's before), None where each joiner awaits its assignment."""

    number: RoundNumber
    record: RoundRecord | None = None


class Assignment(Record):
    """Round `number` for `node_id`: its place (None: a joiner the round left out, which reads
    the closing record), and what the closing record says of the budget and exclusions."""

    number: RoundNumber
    node_id: NodeId
    place: Place | None
    nproc: Annotated[int, Field(ge=1, le=65536)] = 1
    restarts: Count
    excluded: dict[NodeId, Reason] = Field(default_factory=dict, max_length=MAX_NODES)
    excluded_epoch: Count = 0
    revision: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    """etcd: the closing record's revision (what the member's liveness watch starts from)."""


def assign_key(node_id: str) -> str:
    return f"{ASSIGN}{node_id}"


def placed(
    found: Assignment | None, slot: str, of: tuple[int, str], codec: RecordCodec
) -> Assignment | None:
    """`found`, read at `slot` for round and node `of`, where it names them and gives a place
    other than node rank 0's (else the closing record is read). One naming another round or
    node is refused, counted (signed, it cannot be moved to another key; unsigned, anyone may
    write anything)."""
    if found is None:
        return None
    if (found.number, found.node_id) != of:
        codec.refuse(slot, "bad_assignment", "names another round or node")
        return None
    return found if found.place is not None and found.place.group_rank > 0 else None


def assignments_of(
    record: RoundRecord, joiners: list[str], revision: int | None = None, list_max: int = LIST_MAX
) -> dict[str, Assignment]:
    """Every joiner's assignment of `record` (a joiner it left out, and every joiner of a round
    of at most `list_max` members, gets one without a place). O(N log N) once, by the
    closer."""
    members = [RoundMember._make(row) for row in record.members]
    ring = sorted({m.node_id for m in members})
    common = Assignment(
        number=record.number,
        node_id="x",  # each joiner's own, below
        place=None,
        restarts=record.restarts,
        excluded=record.excluded,
        excluded_epoch=record.excluded_epoch,
        revision=revision,
    )
    out: dict[str, Assignment] = {}
    if not record.aborted and len(members) > list_max:
        leader = record.members[0]
        world = sum(m.nproc for m in members)
        base = 0
        for rank, member in enumerate(members):
            if member.node_id in out:
                continue
            successor = ring_successor(ring, member.node_id)
            place = Place(
                group_rank=rank,
                size=len(members),
                base_global_rank=base,
                world_size=world,
                leader=leader,
                successor=successor,
            )
            update = {"node_id": member.node_id, "place": place, "nproc": member.nproc}
            out[member.node_id] = common.model_copy(update=update)
            base += member.nproc
    for node in joiners:
        if node not in out:
            out[node] = common.model_copy(update={"node_id": node})
    return out


def round_of(assignment: Assignment, place: Place, restarts: int) -> Round:
    """The round a member holds from its assignment: no list (Round.members None)."""
    return Round(
        number=assignment.number,
        restarts=restarts,
        group_rank=place.group_rank,
        excluded=assignment.excluded,
        size=place.size,
        leader=place.leader,
        nproc=assignment.nproc,
        base_global_rank=place.base_global_rank,
        world_size=place.world_size,
        successor=place.successor,
    )
