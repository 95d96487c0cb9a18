"""A joiner's round on etcd as it holds it (ftd/coordination/assignment.py): the closer
writes every joiner's assignment after the close's transaction; a joiner awaits its own."""

from __future__ import annotations

import asyncio
import logging

from ftd.coordination.assignment import (
    ASSIGN_GRACE_S,
    ASSIGNING,
    ETCD_BATCH,
    MAX_ASSIGNMENT_BYTES,
    Assignment,
    ClosedMark,
    assign_key,
    assignments_of,
    placed,
)
from ftd.coordination.etcd.kv import RecordKv
from ftd.coordination.records import MAX_ROUND_RECORD_BYTES, RoundRecord
from ftd.coordination.shared_rounds import key
from ftd.tasks import Background

log = logging.getLogger("ftd.rendezvous")


def assign_grace_s(call_timeout_s: float) -> float:
    """How long after a round's `assigning` mark a joiner waits for its assignment: a live
    closer has written them within one call's timeout (ASSIGN_GRACE_S past it)."""
    return ASSIGN_GRACE_S + call_timeout_s


async def write_assignments(
    kv: RecordKv, record: RoundRecord, joiners: list[str], revision: int, list_max: int
) -> None:
    """Write each joiner's assignment of `record` (closed at `revision`), in batches of
    ETCD_BATCH puts a transaction. One that fails is said: its joiners read the closing
    record after the grace (await_assignment)."""
    assigned = list(assignments_of(record, joiners, revision, list_max).items())
    batches = [assigned[i : i + ETCD_BATCH] for i in range(0, len(assigned), ETCD_BATCH)]

    async def write(batch: list[tuple[str, Assignment]]) -> None:
        await kv.txn((), [kv.put_op(key(record.number, assign_key(n)), a) for n, a in batch])

    done = await asyncio.gather(*(write(b) for b in batches), return_exceptions=True)
    failed = [error for error in done if isinstance(error, BaseException)]
    if failed:
        log.warning(
            "round %d: %d of %d batches of assignments not written (%s): their nodes read "
            "the closing record",
            record.number,
            len(failed),
            len(batches),
            failed[0],
        )


async def await_assignment(
    kv: RecordKv, tasks: Background, of: tuple[int, str], absent: int | None, grace_s: float
) -> tuple[RoundRecord | Assignment, int | None] | bool:
    """Round `number` (`of`) as `me` holds it, and the closing record's revision: its
    assignment where it has a place other than node rank 0's, the record where the round's
    `assigning` mark carries it (a short round); else whether the closing record is there to
    be read (True: its assignment has no place; False: none came within `grace_s` of the mark:
    ASSIGN_GRACE_S past the closer's call timeout, when a live closer has written them). Two
    watches (its key, the mark) from `absent`, the join's revision."""
    number, me = of
    mine = tasks.adopt(_assigned(kv, number, me, absent), f"ftd-etcd-assign-{number}")
    mark = tasks.adopt(_marked(kv, number, absent, grace_s), f"ftd-etcd-assigning-{number}")
    try:
        await asyncio.wait({mine, mark}, return_when=asyncio.FIRST_COMPLETED)
        if mine.done():
            return mine.result()
        return mark.result() or False
    finally:
        for task in (mine, mark):
            task.cancel()


async def _assigned(
    kv: RecordKv, number: int, me: str, absent: int | None
) -> tuple[Assignment, int | None] | bool:
    slot = key(number, assign_key(me))
    found, revision = await kv.await_decided(
        slot, Assignment, MAX_ASSIGNMENT_BYTES, absent_at=absent
    )
    if (mine := placed(found, slot, (number, me), kv.codec)) is None:
        return True  # no place, node rank 0's or refused: the record, read
    return mine, mine.revision if mine.revision is not None else revision


async def _marked(
    kv: RecordKv, number: int, absent: int | None, grace_s: float
) -> tuple[RoundRecord, int] | None:
    """The record the round's mark carries (a short round), else None `grace_s` after it."""
    slot = key(number, ASSIGNING)
    mark, revision = await kv.await_decided(
        slot, ClosedMark, MAX_ROUND_RECORD_BYTES, absent_at=absent
    )
    if mark.record is not None and mark.number == mark.record.number == number:
        return mark.record, revision
    await asyncio.sleep(grace_s)
    return None
