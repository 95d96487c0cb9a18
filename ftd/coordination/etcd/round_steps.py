"""The round rules' steps (ftd/coordination/round_rules.py) on etcd: transactions and watches
(rounds.py, kv.py), each waiting out an absent etcd up to the join deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from ftd.coordination.assignment import Assignment
from ftd.coordination.etcd.assigned import await_assignment
from ftd.coordination.etcd.client import EtcdError, lease_gone
from ftd.coordination.etcd.kv import RecordKv
from ftd.coordination.etcd.liveness import EtcdLiveness
from ftd.coordination.etcd.rounds import EtcdRounds
from ftd.coordination.records import (
    MAX_ROUND_RECORD_BYTES,
    Member,
    RequestRecord,
    RoundRecord,
)
from ftd.coordination.shared_rounds import Late, key
from ftd.tasks import Background

T = TypeVar("T")


class EtcdRoundSteps:
    def __init__(
        self,
        kv: RecordKv,
        rounds: EtcdRounds,
        liveness: EtcdLiveness,
        tasks: Background,
        grace_s: float,
    ) -> None:
        self._grace_s = grace_s
        """How long after a round's `assigning` mark a joiner waits for its assignment."""
        self._kv = kv
        self.book = rounds
        self._liveness = liveness
        self._tasks = tasks
        self.closed_at: int | None = None
        """The revision of the closing record of the round this node joined last."""

    async def enter(self, me: Member, deadline: float) -> tuple[int, int] | Late:
        async def join() -> tuple[int, int] | Late:
            lease = self._liveness.lease_id
            try:
                return await self.book.enter(me, lease)
            except EtcdError as error:
                if not lease_gone(error):
                    raise
            # It expired as this node's keepalives went unanswered (a loaded etcd, at 1,024
            # nodes on 2 cores): the node joins under the lease that replaces it.
            return await self.book.enter(me, await self._liveness.replaced(lease))

        return await self._kv.call("join a round", join, deadline)

    async def closing(self, number: int, me: str) -> tuple[RoundRecord | Assignment, int | None]:
        # The join compared the closing record absent (the mark is written with it): the
        # watches start after the join, with no read (1,024 reads fewer as a round forms).
        joined = self.book.joined_at
        absent = joined[1] if joined is not None and joined[0] == number else None
        found = await await_assignment(self._kv, self._tasks, (number, me), absent, self._grace_s)
        if isinstance(found, tuple):
            return found
        if found:  # the record is there (the assignments follow it): read, not watched from
            # the past, which waits for etcd's catch-up loop (up to 100 ms a round)
            record, revision = await self._kv.read_decided(
                key(number, "closed"), RoundRecord, MAX_ROUND_RECORD_BYTES
            )
            if record is not None:
                return record, revision
        return await self._kv.await_decided(
            key(number, "closed"), RoundRecord, MAX_ROUND_RECORD_BYTES, absent_at=absent
        )

    async def close(self, number: int, abort: bool, deadline: float) -> None:
        what = f"close round {number}"
        await self._kv.call(what, lambda: self.book.close(number, abort), deadline)

    async def returning(self, number: int, deadline: float) -> list[str]:
        what = f"read round {number - 1}'s members"
        return await self._kv.call(what, lambda: self.book.returning(number), deadline)

    async def joined(self, number: int, names: bool) -> tuple[int, list[str]]:
        return await self.book.joined_some(number, names)

    async def ask(self, number: int, request: RequestRecord, deadline: float) -> None:
        decided = key(number, "request")
        await self._kv.call(
            f"ask round {number} to restart",
            lambda: self._kv.decide(decided, request, RequestRecord),
            deadline,
        )

    async def ending(self, number: int) -> RequestRecord:
        ended, _ = await self._kv.await_decided(key(number, "request"), RequestRecord)
        return ended

    async def register_standby(self, late: Late, since: float) -> None:
        await self.book.stand_by(late, self._liveness.lease_id, since)

    def spawn(self, work: Coroutine[Any, Any, T], name: str) -> asyncio.Future[T]:
        """A task the caller awaits or drops (a round that ended otherwise)."""
        return self._tasks.adopt(work, f"ftd-etcd-{name}")

    def watch(self, node_ids: list[str], revision: int | None) -> None:
        assert revision is not None  # etcd's closing record has its revision
        self.closed_at = revision
        self._liveness.watch(node_ids, revision)
