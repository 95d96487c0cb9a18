"""The rounds of the TCPStore coordinator, as blocking calls on one RecordStore connection.

See tcpstore.py for the keys. Each call runs on a StoreThread; the coordinator's connections
(store_connections.py) turn them into awaitables and the event loop owns every deadline.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from functools import partial
from typing import Any

from ftd.config.serve import ServeConfig
from ftd.coordination.base import CoordinationError, Round, new_request, order_members
from ftd.coordination.c10d.assigned import roster, write_assignments
from ftd.coordination.c10d.record_store import RecordStore
from ftd.coordination.exclusion_ledger import ExclusionLedger
from ftd.coordination.memo import BytesMemo
from ftd.coordination.records import (
    MAX_ROUND_RECORD_BYTES,
    ExcludedRecord,
    MarkRecord,
    Member,
    NodeSummary,
    RecordCodec,
    RequestRecord,
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
    StandbyRecord,
    cluster_nodes,
    viewed_round,
)
from ftd.text import is_decimal

log = logging.getLogger("ftd.rendezvous")

MAX_JOINERS_READ = 100_000
JOIN_RECORD_GRACE_S = 5.0
"""How long a closer waits for the join record of a node that has taken its place in the
join counter but not written the record yet (the next store call of a live daemon)."""


class StoreRounds:
    """Joining, closing and reading rounds; what this daemon has seen of the budget."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.node_id = config.node_id
        self.list_max = config.rdzv_list_max
        """Rounds of at most this many members are read whole by each (assignment.py)."""
        self.known_restarts = 0
        """The highest restart count this daemon has seen: it never accepts a lower one."""
        self.round_hint = 0
        """The next round this daemon may join (never an older one)."""
        self.exclusions = ExclusionLedger()
        """The newest exclusion this daemon has seen: a replay never rolls it back."""
        self.closing = False
        self.standing_by: Late | None = None
        """The newest round this daemon found full and waited for as a standby."""
        self.summaries: BytesMemo[dict[str, Any]] = BytesMemo()
        """The cluster view's summaries as last read (most are unchanged at the next read)."""

    def enter(self, s: RecordStore, me: Member) -> tuple[int, int] | Late:
        """Blocking: find the open round and join it as its n-th joiner (or find it closed)."""
        number = max(self.read_round_hint(s), self.round_hint)
        while True:
            if self.closing:
                raise CoordinationError("the daemon is stopping", "stopped")
            mark = s.read(f"excluded/{me.node_id}", MarkRecord)
            if mark is not None:
                raise excluded_error(me.node_id, self.config.run_id, mark.reason)
            if (  # this daemon saw it excluded: unless it was readmitted since
                me.node_id in self.exclusions.nodes
                and (reason := self.read_excluded(s).get(me.node_id)) is not None
            ):
                raise excluded_error(me.node_id, self.config.run_id, reason)
            request = s.decided(key(number, "request"), RequestRecord)
            if request is not None:
                if request.action != "restart":
                    raise CoordinationError(f"the job is over: {request.reason}", request.action)
                s.compare_set("round", str(number), str(number + 1))
                number += 1
                continue
            closed = s.decided(key(number, "closed"), RoundRecord, MAX_ROUND_RECORD_BYTES)
            if closed is not None:
                if closed.aborted:
                    raise CoordinationError(closed.aborted)
                self.exclusions.learn(closed)
                if (reason := self.exclusions.nodes.get(me.node_id)) is not None:
                    raise excluded_error(me.node_id, self.config.run_id, reason)
                return Late(number, closed)
            n = s.count(key(number, "joined"), 1, partial(self.joiners_written, s, number))
            s.put(key(number, f"node/{n}"), me)
            log.info("joined round %d as joiner %d", number, n)
            return number, n

    def read_round_hint(self, s: RecordStore) -> int:
        raw = s.get_if_present("round")
        if raw is None:
            s.compare_set("round", "", "0")
            return 0
        text = raw.decode(errors="replace").strip()
        if not is_decimal(text) or len(text) > 9:
            s.codec.refused["bad_round_hint"] += 1
            log.warning("ignored the round hint %r (not a round number)", raw[:40])
            s.compare_set("round", raw.decode(errors="replace"), str(self.round_hint))
            return self.round_hint
        number = int(text)
        # The hint is unsigned: followed only past a round that really closed (every hint ftd
        # writes is). Joining an unproven far round would lose the budget the rounds between
        # carry (the closer counts from the previous round's records); walking up from what
        # this daemon knows reads each round's own signed records instead.
        if number > max(self.round_hint, 0) and (
            s.decided(key(number - 1, "closed"), RoundRecord, MAX_ROUND_RECORD_BYTES) is None
        ):
            s.codec.refused["unproven_round_hint"] += 1
            log.warning(
                "ignored the round hint %d: round %d never closed (walking up from round %d)",
                number,
                number - 1,
                self.round_hint,
            )
            return self.round_hint
        return number

    def joiners_written(self, s: RecordStore, number: int) -> int:
        """How many join records round `number` has (to repair a forged join counter)."""
        n = 0
        while n < MAX_JOINERS_READ and s.check([key(number, f"node/{n + 1}")]):
            n += 1
        return n

    @staticmethod
    def await_closed(s: RecordStore, number: int) -> RoundRecord:
        return s.await_decided(key(number, "closed"), RoundRecord, MAX_ROUND_RECORD_BYTES)

    @staticmethod
    def closed_now(s: RecordStore, number: int) -> RoundRecord | None:
        return s.decided(key(number, "closed"), RoundRecord, MAX_ROUND_RECORD_BYTES)

    @staticmethod
    def request_now(s: RecordStore, number: int) -> RequestRecord | None:
        return s.decided(key(number, "request"), RequestRecord)

    @staticmethod
    def decide_request(s: RecordStore, number: int, request: RequestRecord) -> RequestRecord:
        return s.decide(key(number, "request"), request, RequestRecord)

    @staticmethod
    def await_request(s: RecordStore, number: int) -> RequestRecord:
        return s.await_decided(key(number, "request"), RequestRecord)

    def close(self, s: RecordStore, number: int, abort: bool) -> None:
        """Blocking: close round `number` with the valid joiners so far, if there are MIN of
        them; at the join deadline, abort it otherwise. One closer wins (decided key)."""
        cfg = self.config
        if s.decided(key(number, "closed"), RoundRecord, MAX_ROUND_RECORD_BYTES) is not None:
            return
        count, found = self.join_records(s, number, JOIN_RECORD_GRACE_S)
        previous = (
            s.decided(key(number - 1, "closed"), RoundRecord, MAX_ROUND_RECORD_BYTES)
            if number > 0
            else None
        )
        if previous is not None:
            self.exclusions.learn(previous)
        excluded = self.read_excluded(s)
        epoch = self.exclusions.newest.epoch
        joined = [m for m in found.values() if m.node_id not in excluded]
        if len(joined) < cfg.nnodes_min:
            if not abort:
                return
            record = aborted_round(
                cfg, number, len(joined), count - len(found), self.known_restarts, excluded
            ).model_copy(update={"excluded_epoch": epoch})
        else:
            before = previous.node_ids() if previous else []
            members = order_members(joined, before)[: cfg.nnodes_max]
            record = RoundRecord(
                number=number,
                members=tuple(members),
                restarts=self.restarts_before(s, number, previous),
                excluded=excluded,
                excluded_epoch=epoch,
            )
        decided = s.decide(key(number, "closed"), record, RoundRecord, MAX_ROUND_RECORD_BYTES)
        if decided != record:
            return
        # What each joiner reads instead of the record (assignment.py): one operation.
        write_assignments(s, record, [m.node_id for m in found.values()], self.list_max)
        if not record.aborted:
            log.info("closed round %d with %d nodes", number, len(record.members))

    def join_records(
        self, s: RecordStore, number: int, grace_s: float = 0.0
    ) -> tuple[int, dict[str, Member]]:
        """Blocking: how many joined round `number` so far, and the valid join records. With a
        grace, wait that long for records counted but not written yet: the MAX-th joiner closes
        the round at once, possibly between an earlier joiner's count and its write."""
        joined = s.count(key(number, "joined"), 0, partial(self.joiners_written, s, number))
        count = min(joined, MAX_JOINERS_READ)
        keys = [key(number, f"node/{i}") for i in range(1, count + 1)]
        if grace_s > 0 and keys and not s.check(keys):
            log.info("round %d: waiting for join records counted but not written yet", number)
            s.wait(keys, grace_s)
        return count, s.read_many(keys, Member)

    def joined_ids(self, s: RecordStore, number: int) -> list[str]:
        """Blocking: the nodes with a valid join record in round `number` so far."""
        return sorted({m.node_id for m in self.join_records(s, number)[1].values()})

    def joined_some(self, s: RecordStore, number: int, names: bool = True) -> tuple[int, list[str]]:
        """Blocking: how many joined round `number` so far, and (`names`) the nodes of its
        first JOINED_NAMES_MAX join records that are valid."""
        joined = s.count(key(number, "joined"), 0, partial(self.joiners_written, s, number))
        shown = min(joined, JOINED_NAMES_MAX) if names else 0
        keys = [key(number, f"node/{i}") for i in range(1, shown + 1)]
        named = sorted({m.node_id for m in s.read_many(keys, Member).values()})
        return max(joined, 0), named  # a forged counter may hold a negative number

    def returning(self, s: RecordStore, number: int) -> list[str]:
        """Blocking: the members of round `number - 1` that round `number` still gives a last
        call (shared_rounds.returning_members)."""
        if number == 0:
            return []
        previous = s.decided(key(number - 1, "closed"), RoundRecord, MAX_ROUND_RECORD_BYTES)
        if previous is None:
            return []
        unhealthy = self.marks(s, number - 1, previous.node_ids(), "unhealthy")
        joined = self.joined_ids(s, number)
        return returning_members(previous, joined, self.read_excluded(s), unhealthy)

    def restarts_before(self, s: RecordStore, number: int, previous: RoundRecord | None) -> int:
        """The restarts used before round `number`, from the previous round's records."""
        if number == 0:
            return self.known_restarts
        base = previous.restarts if previous is not None else self.known_restarts
        base += self.respawns(s, number - 1)
        request = s.decided(key(number - 1, "request"), RequestRecord)
        if request is not None and request.action == "restart" and request.counted:
            base += 1
        return max(base, self.known_restarts)

    def respawns(self, s: RecordStore, number: int) -> int:
        """In-process respawns charged in round `number`: each is counted, then written; one
        counted but not written yet is waited for (JOIN_RECORD_GRACE_S at most), so the
        budget never misses it."""
        count = min(s.count(key(number, "respawns"), 0, lambda: 0), MAX_JOINERS_READ)
        keys = [key(number, f"respawn/{k}") for k in range(1, count + 1)]
        if keys and not s.check(keys):
            s.wait(keys, JOIN_RECORD_GRACE_S)
        return len(s.read_many(keys, MarkRecord))

    def marks(self, s: RecordStore, number: int, members: Sequence[str], kind: str) -> set[str]:
        keys = {key(number, f"{kind}/{node}"): node for node in members}
        found = s.read_many(list(keys), MarkRecord)
        return {keys[k] for k, mark in found.items() if mark.node_id == keys[k]}

    def mark_succeeded(self, s: RecordStore, rnd: Round) -> None:
        """This node's ranks exited 0; the last node to say so (or to be unhealthy) ends the
        round as succeeded. Each node reads two counts; only a node whose counts say every
        member may be done reads the members' marks: O(N) once at the job's end, not by each of
        N nodes (issue 43)."""
        succeeded = self.mark(s, rnd, "succeeded", self.node_id)
        unhealthy = self.marked(s, rnd, "unhealthy", 0)
        if succeeded + unhealthy < rnd.size:
            return
        members = roster(s, rnd)
        done = self.marks(s, rnd.number, members, "succeeded") | self.marks(
            s, rnd.number, members, "unhealthy"
        )
        if done >= set(members):
            request = new_request("succeed", "every node's ranks exited 0", self.node_id)
            s.decide(key(rnd.number, "request"), request, RequestRecord)

    def mark_unhealthy(self, s: RecordStore, rnd: Round, node_id: str) -> int:
        """`node_id` is unhealthy; how many members are not, as counted (where several nodes
        mark one node at once, the others may answer before its maker's count has it: the
        maker's answer, and every later one, does)."""
        return rnd.size - self.mark(s, rnd, "unhealthy", node_id)

    def mark(self, s: RecordStore, rnd: Round, kind: str, node_id: str) -> int:
        """Write `node_id`'s mark of `kind` unless it has one; how many members have one. A
        mark made here adds one to the kind's count after it is written, so the count a node
        reads covers every mark written before its own (the last to mark sees them all); a
        mark already there (another node's word on the same node) adds nothing."""
        slot = key(rnd.number, f"{kind}/{node_id}")
        # The nonce makes this write's bytes its own: compare_set answers with them only
        # where this call created the mark.
        mark = MarkRecord(node_id=node_id, reason=f"by {self.node_id} {uuid.uuid4().hex[:8]}")
        mine = s.codec.encode(slot, mark)
        held = s.compare_set(slot, "", mine)
        made = held == mine.encode()
        if not made:
            found = s.codec.decode(slot, held, MarkRecord)
            if found is None or found.node_id != node_id:  # forged: overwritten, as ever
                s.set(slot, mine)
                made = True
        return self.marked(s, rnd, kind, 1 if made else 0)

    def marked(self, s: RecordStore, rnd: Round, kind: str, adding: int) -> int:
        """The count of members marked `kind` (after adding `adding`); a forged count is
        repaired from the marks themselves."""
        return s.count(
            key(rnd.number, f"{kind}-count"),
            adding,
            lambda: len(self.marks(s, rnd.number, roster(s, rnd), kind)),
        )

    def cluster_view(
        self, s: RecordStore, rnd: Round | None
    ) -> tuple[list[dict[str, Any]], dict[str, str], tuple[str, ...]]:
        """Every member's, standby's (and this node's) published summary with its role, the
        excluded nodes, and the members of `rnd`."""
        members = roster(s, rnd) if rnd is not None else ()
        view = viewed_round(rnd, members, self.standing_by, self.node_id)
        standbys = self.standbys(s, view.number) if view.number is not None else set()
        names = sorted({*view.members, *standbys, self.node_id})
        found = s.values_of([f"status/{n}" for n in names])
        decoded = partial(summary_of, s.codec)
        shown = self.summaries.take(((k, raw, (k, raw)) for k, raw in found.items()), decoded)
        summaries = {k.removeprefix("status/"): v for k, v in shown.items()}
        return cluster_nodes(summaries, view, standbys), self.read_excluded(s), members

    def stand_by(self, s: RecordStore, late: Late, since: float) -> None:
        """Blocking: register as a standby of round `late.number`, in its next slot."""
        self.standing_by = late
        counter = key(late.number, "standby")
        k = s.count(counter, 1, partial(self.standbys_written, s, late.number))
        s.put(key(late.number, f"standby/{k}"), StandbyRecord(node_id=self.node_id, since=since))

    def standbys_written(self, s: RecordStore, number: int) -> int:
        """How many standby records round `number` has (to repair a forged counter)."""
        n = 0
        while n < MAX_STANDBYS_READ and s.check([key(number, f"standby/{n + 1}")]):
            n += 1
        return n

    def standbys(self, s: RecordStore, number: int) -> set[str]:
        """Blocking: the nodes registered as standbys of round `number` (its first
        MAX_STANDBYS_READ slots; an invalid record is skipped, counted by the codec)."""
        written = s.count(key(number, "standby"), 0, partial(self.standbys_written, s, number))
        keys = [key(number, f"standby/{k}") for k in range(1, min(written, MAX_STANDBYS_READ) + 1)]
        return {record.node_id for record in s.read_many(keys, StandbyRecord).values()}

    def read_excluded(self, s: RecordStore) -> dict[str, str]:
        record = s.read("excluded", ExcludedRecord, MAX_ROUND_RECORD_BYTES)
        return self.exclusions.merge(record, s.codec)

    def update_excluded(self, s: RecordStore, node_id: str, reason: str | None) -> dict[str, str]:
        for _ in range(1000):
            raw = s.get_if_present("excluded")
            current = (
                s.codec.decode("excluded", raw, ExcludedRecord, MAX_ROUND_RECORD_BYTES)
                if raw is not None
                else None
            )
            update = self.exclusions.updated(current, node_id, reason)
            nodes = dict(update.nodes)
            desired = s.codec.encode("excluded", update)
            expected = raw.decode(errors="replace") if raw is not None else ""
            if s.compare_set("excluded", expected, desired) == desired.encode():
                self.exclusions.merge(update, s.codec)
                break
        else:
            raise CoordinationError("could not update the excluded nodes (contention)")
        if reason is None:
            s.delete_key(f"excluded/{node_id}")
        else:
            s.put(f"excluded/{node_id}", MarkRecord(node_id=node_id, reason=reason[:4000]))
        return nodes


def summary_of(codec: RecordCodec, found: tuple[str, bytes]) -> dict[str, Any] | None:
    """A published summary as the cluster view shows it (None: invalid, counted)."""
    record = codec.decode(*found, NodeSummary)
    return None if record is None else record.model_dump()
