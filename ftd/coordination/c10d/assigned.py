"""A joiner's round on c10d as it holds it (ftd/coordination/assignment.py): its assignment,
or the closing record where it has none, is node rank 0, or where the list is asked for."""

from __future__ import annotations

import logging

from ftd.coordination.assignment import (
    ASSIGN_GRACE_S,
    MAX_ASSIGNMENT_BYTES,
    Assignment,
    assign_key,
    assignments_of,
    placed,
)
from ftd.coordination.base import CoordinationError, Round
from ftd.coordination.c10d.record_store import RecordStore
from ftd.coordination.records import MAX_ROUND_RECORD_BYTES, RoundRecord
from ftd.coordination.shared_rounds import key

log = logging.getLogger("ftd.rendezvous")


def await_assigned(s: RecordStore, number: int, me: str) -> RoundRecord | Assignment:
    """Blocking: round `number` once closed, as `me` holds it: its assignment where it has a
    place other than node rank 0's, written by the closer right after the closing record
    (waited for ASSIGN_GRACE_S at most), else the closing record. Four operations where the
    closing record alone took three."""
    closed = s.slot(key(number, "closed"), 0)
    s.wait([closed])
    slot = key(number, assign_key(me))
    if s.wait([slot], ASSIGN_GRACE_S):
        found = s.codec.decode(slot, s.get(slot), Assignment, MAX_ASSIGNMENT_BYTES)
        if (mine := placed(found, slot, (number, me), s.codec)) is not None:
            return mine
        record = s.codec.decode(closed, s.get(closed), RoundRecord, MAX_ROUND_RECORD_BYTES)
        if record is not None:
            return record
    return s.await_decided(key(number, "closed"), RoundRecord, MAX_ROUND_RECORD_BYTES)


def assigned_now(s: RecordStore, number: int, me: str) -> RoundRecord | Assignment | None:
    """`me`'s assignment of round `number` where it is there and has a place other than node
    rank 0's, else the closing record (None: not closed yet)."""
    slot = key(number, assign_key(me))
    found = s.read(slot, Assignment, MAX_ASSIGNMENT_BYTES)
    if (mine := placed(found, slot, (number, me), s.codec)) is not None:
        return mine
    return s.decided(key(number, "closed"), RoundRecord, MAX_ROUND_RECORD_BYTES)


def roster(s: RecordStore, rnd: Round) -> tuple[str, ...]:
    """Blocking: round `rnd`'s members' ids, read from its closing record where this node
    holds only its assignment (for an operator's view, the job's end, a count's repair: O(N),
    never once a round on every node)."""
    if rnd.node_ids is not None:
        return rnd.node_ids
    record = s.decided(key(rnd.number, "closed"), RoundRecord, MAX_ROUND_RECORD_BYTES)
    if record is None:
        raise CoordinationError(f"round {rnd.number}'s closing record is gone or invalid")
    return tuple(record.node_ids())


def write_assignments(
    s: RecordStore, record: RoundRecord, joiners: list[str], list_max: int
) -> None:
    """Blocking: each joiner's assignment of `record`, in one operation (the closer's, right
    after deciding the record). A failure is said, never raised: the joiners then read the
    closing record after ASSIGN_GRACE_S."""
    try:
        assigned = assignments_of(record, joiners, None, list_max)
        slots = {key(record.number, assign_key(node)): a for node, a in assigned.items()}
        s.multi_set(list(slots), [s.codec.encode(k, a) for k, a in slots.items()])
    except Exception as error:  # contained: the closing record is the truth
        log.warning(
            "round %d: assignments not written (%s): joiners read the record", record.number, error
        )
