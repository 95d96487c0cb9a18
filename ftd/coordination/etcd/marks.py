"""The marks of an etcd round: a node succeeded, a node is unhealthy, an in-process respawn
charged to the budget (keys in rounds.py)."""

from __future__ import annotations

import uuid
from collections.abc import Collection

from ftd.coordination.base import Round
from ftd.coordination.etcd.client import Get, RangeResult
from ftd.coordination.etcd.kv import RecordKv
from ftd.coordination.records import MarkRecord
from ftd.coordination.shared_rounds import key


class EtcdMarks:
    def __init__(self, kv: RecordKv, node_id: str) -> None:
        self._kv = kv
        self._node_id = node_id

    def marked(
        self, rnd: Round, kind: str, found: RangeResult, members: Collection[str] | None
    ) -> set[str]:
        """Nodes with a valid mark of `kind` (a mark names the node its key names): of
        `members`, where given (None: this node holds only its assignment; a signed mark is
        made for a member only)."""
        among = None if members is None else set(members)
        return {
            mark.node_id
            for k, mark in self._kv.valid(found, MarkRecord).items()
            if k == key(rnd.number, f"{kind}/{mark.node_id}")
            and (among is None or mark.node_id in among)
        }

    async def mark(
        self, rnd: Round, kind: str, node_id: str, *also: str, counts: bool = False
    ) -> list[RangeResult]:
        """Write `node_id`'s mark of `kind`, then read the marks of `kind` and each of `also`,
        at once (`counts`: how many only, one number per kind, not every member's mark)."""
        slot = key(rnd.number, f"{kind}/{node_id}")
        limit = 1 if counts else 0  # 1: the range's count, one key at most
        reads = [Get(key(rnd.number, f"{k}/"), prefix=True, limit=limit) for k in (kind, *also)]
        result = await self._kv.txn(
            (), [self._kv.put_op(slot, MarkRecord(node_id=node_id)), *reads]
        )
        return [r for r in result.responses if isinstance(r, RangeResult)]

    async def marks_now(self, rnd: Round, members: Collection[str], *kinds: str) -> list[set[str]]:
        """The `members` marked each of `kinds`, read at one revision."""
        _, found = await self._kv.reads(
            *(Get(key(rnd.number, f"{k}/"), prefix=True) for k in kinds)
        )
        return [self.marked(rnd, k, r, members) for k, r in zip(kinds, found, strict=True)]

    async def respawns(self, number: int) -> int:
        _, (found,) = await self._kv.reads(Get(key(number, "respawn/"), prefix=True))
        return len(self._kv.valid(found, MarkRecord))

    async def charge_respawn(self, number: int, reason: str) -> int:
        """Record one in-process respawn in round `number`: the respawns recorded so far."""
        slot = key(number, f"respawn/{self._node_id}.{uuid.uuid4().hex[:12]}")
        result = await self._kv.txn(
            (),
            [
                self._kv.put_op(slot, MarkRecord(node_id=self._node_id, reason=reason[:4000])),
                Get(key(number, "respawn/"), prefix=True),
            ],
        )
        found = result.responses[1]
        assert isinstance(found, RangeResult)
        return len(self._kv.valid(found, MarkRecord))
