"""A closed round as the members of the round before read it (issue 43): what it kept of their
list, in runs, and the rows new to it.

Every member waits for its round's closing record, N members long: N nodes reading N rows is
b N² bytes a round, all served by the one store (31 MB at 1,024 nodes, 0.9 GB at 4,096 with
real names; packed since record_body.py, a tenth of that). A restart keeps nearly every member where
it was, so the closer of round N (which reads round N-1's record to order the members) also
writes `RoundDelta`, decided beside the closing record: round N-1's rows it keeps as runs of
their places, the rows that are new. A member of round N-1 waits for that instead and rebuilds
the list from its own copy: a restart costs each such node O(changes) bytes, the job O(N). A
node without round N-1's list (round 0, a newcomer, a standby, a daemon restarted) reads the
closing record itself, as does one whose rebuilt list does not match the digest (counted,
`bad_round_delta`): the closing record stays the truth.
"""

from __future__ import annotations

import hashlib
from typing import Annotated

from pydantic import Field

from ftd.coordination.base import Round
from ftd.coordination.records import (
    MAX_NODES,
    MAX_ROUND_RECORD_BYTES,
    Count,
    MemberRow,
    NodeId,
    Reason,
    Record,
    RecordCodec,
    RoundNumber,
    RoundRecord,
)

DELTA = "closed_delta"
"""The key of round N's delta, beside its closing record (`r<N>/closed`)."""
MAX_DELTA_BYTES = MAX_ROUND_RECORD_BYTES
ADDED = -1
"""A run's start that means: the next rows of `added`, not of the round before."""

RunStart = Annotated[int, Field(ge=ADDED, lt=MAX_NODES)]
RunLength = Annotated[int, Field(ge=1, le=MAX_NODES)]


class RoundDelta(Record):
    """Round `number`'s closing record against round `base`'s members: the members are, in
    order, each run's rows (`base`'s from `start` on, or the next of `added` where `start` is
    ADDED); `digest` is the members' (members_digest)."""

    number: RoundNumber
    base: RoundNumber
    runs: tuple[tuple[RunStart, RunLength], ...] = Field(max_length=MAX_NODES)
    added: tuple[MemberRow, ...] = Field(max_length=MAX_NODES)
    digest: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
    restarts: Count
    excluded: dict[NodeId, Reason] = Field(default_factory=dict, max_length=MAX_NODES)
    excluded_epoch: Count = 0
    aborted: Reason | None = None
    whole: bool = False
    """Most rows are new: read the closing record itself (no delta near its size: the close's
    etcd transaction holds both)."""


def members_digest(members: tuple[MemberRow, ...]) -> str:
    """The members' node ids in order (a kept row is its base row whole, a new one the delta's:
    the ids place every row; 0.02 ms at 1,024 members where their JSON took 0.26)."""
    body = "\n".join([row[0] for row in members]).encode()
    return hashlib.blake2b(body, digest_size=16).hexdigest()


def delta_of(record: RoundRecord, base: RoundRecord | None) -> RoundDelta:
    """`record` against the round before's (`base`; None: every row is new)."""
    place = {row: i for i, row in enumerate(base.members)} if base is not None else {}
    runs: list[tuple[int, int]] = []
    added: list[MemberRow] = []
    for row in record.members:
        at = place.get(row, ADDED)
        if at == ADDED:
            added.append(row)
        last = runs[-1] if runs else None
        if last is not None and (last[0] == at == ADDED or ADDED != last[0] == at - last[1]):
            runs[-1] = (last[0], last[1] + 1)
        else:
            runs.append((at, 1))
    whole = len(added) > len(record.members) // 2
    return RoundDelta(
        number=record.number,
        base=base.number if base is not None else max(record.number - 1, 0),
        runs=() if whole else tuple(runs),
        added=() if whole else tuple(added),
        whole=whole,
        digest=members_digest(record.members),
        restarts=record.restarts,
        excluded=record.excluded,
        excluded_epoch=record.excluded_epoch,
        aborted=record.aborted,
    )


def resolve(delta: RoundDelta, base_number: int, base: tuple[MemberRow, ...]) -> RoundRecord | None:
    """The closing record `delta` stands for, from round `base_number`'s members; None where it
    cannot be rebuilt from them (`whole`, another base, runs out of bounds, a digest that
    differs): then the closing record itself is read."""
    if delta.whole:
        return None
    if delta.aborted is not None:
        members: tuple[MemberRow, ...] = ()
    else:
        if delta.base != base_number:
            return None
        rows: list[MemberRow] = []
        taken = 0
        for start, length in delta.runs:
            if len(rows) + length > MAX_NODES:
                return None
            if start == ADDED:
                if taken + length > len(delta.added):
                    return None
                rows.extend(delta.added[taken : taken + length])
                taken += length
            elif start + length <= len(base):
                rows.extend(base[start : start + length])
            else:
                return None
        members = tuple(rows)
        if taken != len(delta.added) or members_digest(members) != delta.digest:
            return None
    # Built from validated records' fields: nothing new to validate (1,024 rows, no call each).
    return RoundRecord.model_construct(
        number=delta.number,
        members=members,
        restarts=delta.restarts,
        excluded=delta.excluded,
        excluded_epoch=delta.excluded_epoch,
        aborted=delta.aborted,
    )


def rebuilt(delta: RoundDelta, base: Round, codec: RecordCodec, slot: str) -> RoundRecord | None:
    """`delta` (read at `slot`) for a member of round `base`: the round, or None where the
    closing record must be read whole (a delta that should have rebuilt it is counted)."""
    record = resolve(delta, base.number, base.members)
    if record is None and not delta.whole:
        codec.refuse(slot, "bad_round_delta", "does not rebuild the round")
    return record
