"""The rounds of the etcd coordinator: each step one read (ranges side by side, all at one
revision: EtcdClient.read) and at most one conditional write. Keys, under the job's root
`<prefix>/ftd/<id>/`:

  round                 RoundHint: the newest round (moved forward by the joins of a newer
                        round; a hint, the truth is in the round's own keys)
  excluded              ExcludedRecord: the excluded nodes (compare-and-swap on mod_revision)
  r<N>/join/<node>      Member, held by the joiner's lease (a joiner that dies vanishes)
  r<N>/joined           touched by every join in the same transaction: its version is the
                        joiner's number, its mod_revision what a close compares against
  r<N>/closed           RoundRecord, decided: members in node-rank order, restarts used
                        before, the excluded nodes (or `aborted`)
  r<N>/assigning        ClosedMark, in the close's transaction: a short round's record (its
                        joiners take it from here), else: the assignments follow
  r<N>/assign/<node>    Assignment, one per joiner, written after the close in batches: what
                        a member reads instead of the closing record (assignment.py)
  r<N>/request          RequestRecord, decided: restart, fail or succeed
  r<N>/request/culprit  JobCulprit, decided after a hang (heard by the request's watch)
  r<N>/succeeded/<node>, r<N>/unhealthy/<node>          MarkRecords
  r<N>/respawn/<node>.<nonce>                           in-process respawns (budget)
  r<N>/inprocess        Member: node rank 0's store for the ranks' in-process rounds
  r<N>/standby/<node>   StandbyRecord: a standby waiting for round N's end, held by its lease
  alive/<node>, status/<node>   AliveRecord, NodeSummary, held by the node's lease

A join is a transaction "if round N is not closed, write my join record and touch `joined`";
a close is "if round N is still not closed and nobody joined since I read the joiners, write
the round record": so a round closes with exactly the nodes that joined it, once.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from ftd.config.serve import ServeConfig
from ftd.coordination.assignment import ASSIGNING, ClosedMark
from ftd.coordination.base import CoordinationError, order_members
from ftd.coordination.etcd.assigned import write_assignments
from ftd.coordination.etcd.client import Get, KeyValue, RangeResult
from ftd.coordination.etcd.kv import RecordKv, RecordMemo
from ftd.coordination.etcd.marks import EtcdMarks
from ftd.coordination.exclusion_ledger import ExclusionLedger
from ftd.coordination.records import (
    MAX_ROUND_RECORD_BYTES,
    ExcludedRecord,
    MarkRecord,
    Member,
    NodeSummary,
    Record,
    RequestRecord,
    RoundNumber,
    RoundRecord,
)
from ftd.coordination.shared_rounds import (
    JOINED_NAMES_MAX,
    Late,
    aborted_round,
    excluded_error,
    key,
    returning_members,
)
from ftd.coordination.standby import (
    MAX_STANDBYS_READ,
    ClusterView,
    StandbyRecord,
    cluster_nodes,
)

log = logging.getLogger("ftd.rendezvous")

MAX_CLOSE_TRIES = 16
"""Closes that lost to a new joiner before one closes without comparing (a flood of joins)."""
MAX_EXCLUDE_TRIES = 100


class RoundHint(Record):
    number: RoundNumber


@dataclass(frozen=True)
class RoundView:
    """Round N as read at one revision."""

    hint: int | None
    excluded: dict[str, str]
    closed: RoundRecord | None
    closed_kv: KeyValue | None
    request: RequestRecord | None


class EtcdRounds:
    """Joining, closing and reading rounds in etcd; what this daemon has seen of the budget."""

    def __init__(self, config: ServeConfig, kv: RecordKv) -> None:
        self.config = config
        self.node_id = config.node_id
        self.kv = kv
        self.list_max = config.rdzv_list_max
        """Rounds of at most this many members are read whole by each (assignment.py)."""
        self.marks = EtcdMarks(kv, self.node_id)
        self.known_restarts = 0
        """The highest restart count this daemon has seen: it never accepts a lower one."""
        self.round_hint = 0
        """The next round this daemon may join (never an older one)."""
        self.exclusions = ExclusionLedger()
        """The newest exclusion this daemon has seen: a replay never rolls it back."""
        self.standing_by: Late | None = None
        """The newest round this daemon found full and waited for as a standby."""
        self.summaries = RecordMemo(kv, NodeSummary, NodeSummary.model_dump)
        """The cluster view's summaries as last read (most are unchanged at the next read)."""
        self.joined_at: tuple[int, int] | None = None
        """The round this node joined last, and the revision of its join (closed was absent)."""

    # -- reading -----------------------------------------------------------------------------

    async def read_cluster(self, view: ClusterView) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """The view's nodes with their published summaries (a record under another node's
        name is skipped) and roles, and the excluded nodes, as etcd has them."""
        spares = key(view.number or 0, "standby/")
        _, (found, excluded, standby) = await self.kv.reads(
            Get("status/", prefix=True), Get("excluded"), Get(spares, True, MAX_STANDBYS_READ)
        )
        summaries = {
            k.removeprefix("status/"): s
            for k, s in self.summaries.valid(found).items()
            if k == f"status/{s['node_id']}"
        }
        standbys = {
            r.node_id
            for k, r in self.kv.valid(standby, StandbyRecord).items()
            if k == f"{spares}{r.node_id}" and view.number is not None
        }
        return cluster_nodes(summaries, view, standbys), self.excluded_of(excluded)

    async def stand_by(self, late: Late, lease: int | None, since: float) -> None:
        """Register as a standby of round `late.number`, under this node's lease (one try)."""
        self.standing_by = late
        record = StandbyRecord(node_id=self.node_id, since=since)
        put = key(late.number, f"standby/{self.node_id}")
        loop = asyncio.get_running_loop()
        await self.kv.call(
            "register as a standby", lambda: self.kv.put(put, record, lease), loop.time()
        )

    def excluded_of(self, found: RangeResult) -> dict[str, str]:
        record, _ = self.kv.first(found, ExcludedRecord, MAX_ROUND_RECORD_BYTES)
        return self.exclusions.merge(record, self.kv.codec)

    async def read_excluded(self) -> dict[str, str]:
        _, (found,) = await self.kv.reads(Get("excluded"))
        return self.excluded_of(found)

    async def read_round(self, number: int) -> RoundView:
        _, (hint, excluded, closed, request) = await self.kv.reads(
            Get("round"), Get("excluded"), Get(key(number, "closed")), Get(key(number, "request"))
        )
        pointer, _ = self.kv.first(hint, RoundHint)
        record, closed_kv = self.kv.first(closed, RoundRecord, MAX_ROUND_RECORD_BYTES)
        decided, _ = self.kv.first(request, RequestRecord)
        return RoundView(
            hint=pointer.number if pointer is not None else None,
            excluded=self.excluded_of(excluded),
            closed=record,
            closed_kv=closed_kv,
            request=decided,
        )

    # -- joining -----------------------------------------------------------------------------

    async def enter(self, me: Member, lease: int) -> tuple[int, int] | Late:
        """Find the open round and join it: (round, joiner number), or Late (it closed
        without this node)."""
        number = self.round_hint
        while True:
            view = await self.read_round(number)
            if view.hint is not None and view.hint > number:
                number = view.hint
                continue
            if view.closed is not None:
                self.exclusions.learn(view.closed)
            if (reason := self.exclusions.nodes.get(me.node_id)) is not None:
                raise excluded_error(me.node_id, self.config.run_id, reason)
            if view.request is not None:
                if view.request.action != "restart":
                    raise CoordinationError(
                        f"the job is over: {view.request.reason} (job {self.config.run_id} "
                        "in etcd; a new run needs a new --rdzv-id, or its keys deleted)",
                        view.request.action,
                    )
                number += 1  # the next round's joiners move the hint
                continue
            if view.closed is not None:
                if view.closed.aborted:
                    raise CoordinationError(view.closed.aborted)
                return Late(number, view.closed)
            joined = key(number, "joined")
            # While round N is open nobody can have moved the hint past N (that takes a
            # request, which takes a closed round): the join may move it to N unconditionally.
            moved = view.hint is None or view.hint < number
            hint = [self.kv.put_op("round", RoundHint(number=number))] if moved else []
            result = await self.kv.txn(
                [self.kv.unchanged(key(number, "closed"), view.closed_kv)],
                [
                    self.kv.put_op(key(number, f"join/{me.node_id}"), me, lease),
                    self.kv.put_op(joined, MarkRecord(node_id=me.node_id)),
                    Get(joined),
                    *hint,
                ],
            )
            if not result.succeeded:
                continue  # closed meanwhile (or garbage replaced): read again
            counter = result.responses[2]
            assert isinstance(counter, RangeResult) and counter.kvs
            joiner = counter.kvs[0].version
            log.info("joined round %d as joiner %d", number, joiner)
            self.joined_at = (number, result.revision)
            return number, joiner

    async def joined_some(self, number: int, names: bool = True) -> tuple[int, list[str]]:
        """How many join records round `number` has so far, and (`names`) the nodes of the
        first JOINED_NAMES_MAX of them (by key) that are valid (else one is read, for the
        count)."""
        limit = JOINED_NAMES_MAX if names else 1
        _, (joins,) = await self.kv.reads(Get(key(number, "join/"), prefix=True, limit=limit))
        if not names:
            return max(joins.count, len(joins.kvs)), []
        valid = self.kv.valid(joins, Member)
        named = {m.node_id for k, m in valid.items() if k == key(number, f"join/{m.node_id}")}
        return max(joins.count, len(joins.kvs)), sorted(named)

    async def returning(self, number: int) -> list[str]:
        """The members of round `number - 1` that round `number` still gives a last call
        (shared_rounds.returning_members)."""
        if number == 0:
            return []
        previous = number - 1
        _, (joins, excluded, closed, unhealthy) = await self.kv.reads(
            Get(key(number, "join/"), prefix=True),
            Get("excluded"),
            Get(key(previous, "closed")),
            Get(key(previous, "unhealthy/"), prefix=True),
        )
        record, _ = self.kv.first(closed, RoundRecord, MAX_ROUND_RECORD_BYTES)
        if record is None:
            return []
        joined = {
            m.node_id
            for k, m in self.kv.valid(joins, Member).items()
            if k == key(number, f"join/{m.node_id}")
        }
        marked = {
            m.node_id
            for k, m in self.kv.valid(unhealthy, MarkRecord).items()
            if k == key(previous, f"unhealthy/{m.node_id}")
        }
        return returning_members(record, joined, self.excluded_of(excluded), marked)

    # -- closing -----------------------------------------------------------------------------

    async def close(self, number: int, abort: bool) -> None:
        """Close round `number` with its valid joiners if there are MIN of them; at the join
        deadline (`abort`), abort it otherwise. One closer wins."""
        for attempt in range(MAX_CLOSE_TRIES):
            previous = number - 1
            (
                _,
                (joins, joined, closed, excluded, prev_closed, prev_request, respawns),
            ) = await self.kv.reads(
                Get(key(number, "join/"), prefix=True),
                Get(key(number, "joined")),
                Get(key(number, "closed")),
                Get("excluded"),
                Get(key(previous, "closed")),
                Get(key(previous, "request")),
                Get(key(previous, "respawn/"), prefix=True),
            )
            decided, closed_kv = self.kv.first(closed, RoundRecord, MAX_ROUND_RECORD_BYTES)
            if decided is not None:
                return
            previous_record = self.kv.first(prev_closed, RoundRecord, MAX_ROUND_RECORD_BYTES)[0]
            if previous_record is not None:
                self.exclusions.learn(previous_record)
            out = self.excluded_of(excluded)
            valid = self.kv.valid(joins, Member)
            members = [
                m
                for k, m in valid.items()
                if k == key(number, f"join/{m.node_id}") and m.node_id not in out
            ]
            record = self._round_record(
                number,
                members,
                out,
                failed=len(joins.kvs) - len(valid),
                previous=previous_record,
                request=self.kv.first(prev_request, RequestRecord)[0],
                respawns=len(self.kv.valid(respawns, MarkRecord)) if number > 0 else 0,
            )
            if record.aborted and not abort:
                return
            compare = [self.kv.unchanged(key(number, "closed"), closed_kv)]
            if attempt < MAX_CLOSE_TRIES - 1:
                counter = joined.kvs[0] if joined.kvs else None
                compare.append(self.kv.unchanged(key(number, "joined"), counter))
            # A short round's joiners take the record from the mark (one event each, as
            # before assignments); a long one's await their assignments, written after.
            short = record.aborted is not None or len(record.members) <= self.list_max
            mark = ClosedMark(number=number, record=record if short else None)
            writes = [
                self.kv.put_op(key(number, "closed"), record),
                self.kv.put_op(key(number, ASSIGNING), mark),
            ]
            result = await self.kv.txn(compare, writes)
            if result.succeeded:
                if not record.aborted:
                    log.info("closed round %d with %d nodes", number, len(record.members))
                if not short:
                    joiners = [
                        m.node_id for k, m in valid.items() if k == key(number, f"join/{m.node_id}")
                    ]
                    await write_assignments(
                        self.kv, record, joiners, result.revision, self.list_max
                    )
                return

    def _round_record(
        self,
        number: int,
        joined: list[Member],
        excluded: dict[str, str],
        *,
        failed: int,
        previous: RoundRecord | None,
        request: RequestRecord | None,
        respawns: int,
    ) -> RoundRecord:
        cfg = self.config
        epoch = self.exclusions.newest.epoch
        if len(joined) < cfg.nnodes_min:
            aborted = aborted_round(cfg, number, len(joined), failed, self.known_restarts, excluded)
            return aborted.model_copy(update={"excluded_epoch": epoch})
        before = previous.node_ids() if previous is not None else []
        restarts = self.known_restarts
        if number > 0:
            restarts = (previous.restarts if previous is not None else 0) + respawns
            if request is not None and request.action == "restart" and request.counted:
                restarts += 1
        return RoundRecord(
            number=number,
            members=tuple(order_members(joined, before)[: cfg.nnodes_max]),
            restarts=max(restarts, self.known_restarts),
            excluded=excluded,
            excluded_epoch=epoch,
        )

    # -- exclusion ---------------------------------------------------------------------------

    async def update_excluded(self, node_id: str, reason: str | None) -> dict[str, str]:
        for _ in range(MAX_EXCLUDE_TRIES):
            _, (found,) = await self.kv.reads(Get("excluded"))
            current, seen = self.kv.first(found, ExcludedRecord, MAX_ROUND_RECORD_BYTES)
            update = self.exclusions.updated(current, node_id, reason)
            result = await self.kv.txn(
                [self.kv.unchanged("excluded", seen)],
                [self.kv.put_op("excluded", update)],
            )
            if result.succeeded:
                return self.exclusions.merge(update, self.kv.codec)
        raise CoordinationError("could not update the excluded nodes (contention)")
