"""The etcd coordinator (`--rdzv-backend etcd`): the c10d coordinator's behaviour on etcd's own
primitives: rounds close and requests are decided with transactions (rounds.py, kv.py), a node
is alive while its lease is (liveness.py), every wait is a watch. No daemon hosts the store, so
any node may die, node rank 0 included; with 3 or 5 members etcd survives a minority's loss.
While etcd has no quorum the attempt goes on; what needs etcd waits, up to --rdzv-join-timeout
(`coordination_unavailable` / `coordination_restored`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from functools import partial
from typing import Any, TypeVar

from ftd.config.serve import ServeConfig
from ftd.coordination.base import (
    CoordinationError,
    NodeLost,
    Report,
    Round,
    RoundWaits,
    cluster_answer,
    new_request,
)
from ftd.coordination.endpoint import parse_endpoint, route_address
from ftd.coordination.etcd.assigned import assign_grace_s
from ftd.coordination.etcd.client import Get
from ftd.coordination.etcd.conf import open_client, parse_etcd_conf, warn_unsigned
from ftd.coordination.etcd.gather import gather_members
from ftd.coordination.etcd.inprocess_meeting import leaders_store
from ftd.coordination.etcd.kv import Availability, RecordKv
from ftd.coordination.etcd.liveness import EtcdLiveness
from ftd.coordination.etcd.members import MemberWatch
from ftd.coordination.etcd.round_end import CULPRIT, RoundEnds
from ftd.coordination.etcd.round_steps import EtcdRoundSteps
from ftd.coordination.etcd.rounds import EtcdRounds
from ftd.coordination.exclusion_ledger import Excluding
from ftd.coordination.progress import Reaching
from ftd.coordination.records import (
    AGGREGATES,
    MAX_ROUND_RECORD_BYTES,
    Collectives,
    JobCulprit,
    Member,
    NodeSummary,
    Record,
    RecordCodec,
    RequestRecord,
    RoundRecord,
)
from ftd.coordination.round_rules import join
from ftd.coordination.shared_rounds import (
    key,
)
from ftd.coordination.standby import cluster_nodes, viewed_round
from ftd.tasks import Background, within
from ftd.tcpstore.server import TcpStoreServer

log = logging.getLogger("ftd.rendezvous")

T = TypeVar("T")


class EtcdCoordinator:
    """One daemon's side of the job's membership over etcd."""

    def __init__(self, config: ServeConfig, secret: bytes | None, report: Report) -> None:
        self.config = config
        self.node_id = config.node_id
        self.conf = parse_etcd_conf(config)
        self.codec = RecordCodec(config.run_id, secret)
        self.lost = asyncio.Event()
        self.lost_reason = ""
        self.round: Round | None = None
        self.excluded: dict[str, str] = {}
        self.reached = self.hosting = False  # no daemon hosts etcd
        self._where = members = ", ".join(self.conf.endpoints)
        self.describe = f"etcd {members} (keys under {self.conf.root})"
        self._report = report
        self._etcd = open_client(
            self.conf,
            max_response_bytes=2 * MAX_ROUND_RECORD_BYTES,
            on_endpoint_failed=lambda endpoint, why: self._members.failed(endpoint, why),
        )
        self._availability = Availability(report, members, lambda: self._etcd.get("round"))
        self._kv = RecordKv(self._etcd, self.codec, self._availability)
        self._rounds = EtcdRounds(config, self._kv)
        self._liveness: EtcdLiveness | None = None
        self._steps: EtcdRoundSteps | None = None
        self._opened = False
        self._tasks = Background()
        self._ends = RoundEnds(self._kv, self._spawn)
        self._members = MemberWatch(
            lambda endpoint: self._etcd.transport.probe(endpoint, self.conf.timeout_s), report
        )
        self._inprocess: TcpStoreServer | None = None
        self._finished = False

    @property
    def address(self) -> str:
        host, port = parse_endpoint(self.conf.endpoints[0].split("://", 1)[1])
        return self.config.local_addr or self.config.master_addr or route_address(host, port)

    @property
    def ops(self) -> int:
        """etcd requests sent by this daemon (watches counted once, keepalives not)."""
        return self._kv.ops

    def _deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.config.rdzv_join_timeout_s

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        """An etcd step that waits out an absent etcd up to --rdzv-join-timeout."""
        return await self._kv.call(what, fn, self._deadline())

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, on_node_lost: NodeLost, waits: RoundWaits | None = None) -> None:
        await self._etcd.__aenter__()
        self._opened = True
        if not self.codec.signed:
            warn_unsigned(self.conf)
        liveness = EtcdLiveness(
            self.node_id,
            self._kv,
            self.conf.lease_ttl_s,
            on_node_lost,
            self._mark_lost,
            self._report,
        )
        reaching = Reaching(self._where, self.config.rdzv_join_timeout_s, waits)
        self._members.reaching = reaching.failed  # each member's failure, said at once
        try:
            await self._kv.call(
                "grant this node's lease", liveness.start, self._deadline(), tried=reaching.failed
            )
        finally:
            self._members.reaching = None
            reaching.done()
        self._liveness = liveness
        grace_s = assign_grace_s(self.conf.timeout_s)
        self._steps = EtcdRoundSteps(self._kv, self._rounds, liveness, self._tasks, grace_s)
        self.excluded = await self._call("read the excluded nodes", self._rounds.read_excluded)
        self.reached = True

    async def close(self) -> None:
        self._kv.closing = True
        await asyncio.gather(self._tasks.close(), self._members.close(), return_exceptions=True)
        await self._availability.close()
        if self._liveness is not None:
            if not self.lost.is_set() and not self._finished:
                with contextlib.suppress(Exception):  # leaving: nobody waits a TTL for it
                    await within(self._liveness.finish(), 2)
            await self._liveness.close(revoke=not self.lost.is_set())
        if self._opened:
            await self._etcd.__aexit__(None, None, None)
        store, self._inprocess = self._inprocess, None
        if store is not None:
            await store.close()

    def _mark_lost(self, why: str) -> None:
        if not self.lost.is_set() and not self._kv.closing:
            self.lost_reason = why
            log.error("%s", why)
            self.lost.set()

    def _spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """A task the caller awaits or drops (a round that ended otherwise)."""
        return self._tasks.adopt(coro, f"ftd-etcd-{name}")

    # -- rounds ------------------------------------------------------------------------------

    async def join(self, me: Member, waits: RoundWaits | None = None) -> Round:
        assert self._steps is not None
        self.round = await join(
            self.config, self._steps, me, self._deadline(), self.round, waits, self._learn
        )
        self._ends.began(self.round.number, self._steps.closed_at)
        return self.round

    def _learn(self, record: Excluding) -> None:
        self.excluded = dict(record.excluded)

    # -- the round's end ---------------------------------------------------------------------

    def ended(self, rnd: Round) -> asyncio.Future[RequestRecord]:
        return self._ends.ended(rnd.number)

    async def request(self, rnd: Round, request: RequestRecord) -> RequestRecord:
        decided = await self._call(
            f"end round {rnd.number} ({request.action})",
            lambda: self._kv.decide(key(rnd.number, "request"), request, RequestRecord),
        )
        if decided == request:
            log.info("round %d: requested %s: %s", rnd.number, request.action, request.reason)
        return decided

    async def restarts_used(self, rnd: Round) -> int:
        respawns = await self._call(
            "count the restarts", lambda: self._rounds.marks.respawns(rnd.number)
        )
        return rnd.restarts + respawns

    async def count_restart(self, rnd: Round, reason: str) -> int:
        respawns = await self._call(
            "charge a restart", lambda: self._rounds.marks.charge_respawn(rnd.number, reason)
        )
        return rnd.restarts + respawns

    async def succeeded(self, rnd: Round) -> None:
        async def mark() -> None:
            # Counts first: only a node whose counts say every member may be done reads the
            # marks (O(N) once at the job's end, not by each of N nodes).
            rounds = self._rounds
            counts = await rounds.marks.mark(
                rnd, "succeeded", self.node_id, "unhealthy", counts=True
            )
            if sum(r.count for r in counts) < rnd.size:
                return
            members = await self._roster(rnd)
            done, unhealthy = await rounds.marks.marks_now(rnd, members, "succeeded", "unhealthy")
            if done | unhealthy >= set(members):
                request = new_request("succeed", "every node's ranks exited 0", self.node_id)
                await self._kv.decide(key(rnd.number, "request"), request, RequestRecord)

        await self._call("mark this node succeeded", mark)

    async def unhealthy(self, rnd: Round, node_id: str) -> int:
        (found,) = await self._call(
            f"mark {node_id} unhealthy", lambda: self._rounds.marks.mark(rnd, "unhealthy", node_id)
        )
        return rnd.size - len(self._rounds.marks.marked(rnd, "unhealthy", found, rnd.node_ids))

    async def leave(self, rnd: Round) -> None:
        """The job is over for this node: say so, so that its keys going is no loss."""
        self.finishing()
        if self._liveness is not None:
            try:
                await self._kv.call("mark this node done", self._liveness.finish, self._soon())
            except CoordinationError:
                log.debug("could not mark this node done", exc_info=True)

    def finishing(self) -> None:
        self._finished = True

    def _soon(self) -> float:
        return asyncio.get_running_loop().time() + 2 * self.conf.timeout_s

    # -- exclusion ---------------------------------------------------------------------------

    async def exclude(self, node_id: str, reason: str) -> None:
        self.excluded = await self._call(
            f"exclude {node_id}", lambda: self._rounds.update_excluded(node_id, reason)
        )

    def readmitting(self, node_id: str) -> bool:
        return self.excluded.pop(node_id, None) is not None

    async def readmit(self, node_id: str) -> None:
        self.excluded = await self._call(
            f"readmit {node_id}", lambda: self._rounds.update_excluded(node_id, None)
        )

    # -- status ------------------------------------------------------------------------------

    async def publish_status(self, summary: dict[str, Any]) -> None:
        record = NodeSummary.model_validate(summary)
        liveness = self._liveness
        if liveness is None:
            return
        await self._kv.call(
            "publish this node's status",
            lambda: self._kv.put(f"status/{self.node_id}", record, liveness.lease_id),
            asyncio.get_running_loop().time(),  # one try: the next change publishes again
        )

    async def publish_aggregate(self, name: str, values: dict[str, Any]) -> None:
        record = AGGREGATES[name].model_validate(values)
        liveness = self._liveness
        if liveness is None:
            return
        await self._kv.call(
            f"publish the job's {name}",
            lambda: self._kv.put(f"aggregate/{name}", record, liveness.lease_id),
            asyncio.get_running_loop().time(),  # one try: the next look writes again
        )

    async def aggregate(self, name: str) -> dict[str, Any] | None:
        return await self._read_one(f"aggregate/{name}", AGGREGATES[name])

    async def summary_of(self, node_id: str) -> dict[str, Any] | None:
        return await self._read_one(f"status/{node_id}", NodeSummary)

    async def _read_one(self, key: str, model: type[Record]) -> dict[str, Any] | None:
        async def read() -> Record | None:
            _, (found,) = await self._kv.reads(Get(key))
            return self._kv.first(found, model)[0]

        now = asyncio.get_running_loop().time()  # one try: the next look reads again
        record = await self._kv.call(f"read {key}", read, now)
        return record.model_dump() if record is not None else None

    async def cluster(self) -> dict[str, Any]:
        """Every member's summary as etcd has it; while etcd does not answer, what this node
        knows, and why the rest is unknown (never an error for the API's caller)."""
        rnd = self.round
        members: Sequence[str] = (rnd.node_ids or (rnd.leader_id,)) if rnd else ()
        unavailable = None
        try:
            if rnd is not None:
                members = await self._kv.call(
                    "read the round", lambda: self._roster(rnd), self._soon()
                )
        except CoordinationError as error:
            unavailable = error.reason
        view = viewed_round(rnd, members, self._rounds.standing_by, self.node_id)
        nodes = cluster_nodes({}, view, ())
        try:
            if unavailable is not None:
                raise CoordinationError(unavailable)
            read = partial(self._rounds.read_cluster, view)
            nodes, self.excluded = await self._kv.call("read the cluster", read, self._soon())
        except CoordinationError as error:
            unavailable = error.reason
        refused = dict(self.codec.refused)
        return cluster_answer(nodes, rnd, self.excluded, self.ops, refused, unavailable, members)

    # -- the job's culprit of a hang (job_culprit.py) ----------------------------------------

    async def roster(self, rnd: Round) -> tuple[str, ...]:
        return await self._call("read the round's members", lambda: self._roster(rnd))

    async def _roster(self, rnd: Round) -> tuple[str, ...]:
        """Round `rnd`'s members' ids, read from its closing record where this node holds
        only its assignment (assignment.py)."""
        if rnd.node_ids is not None:
            return rnd.node_ids
        slot = key(rnd.number, "closed")
        record, _ = await self._kv.read_decided(slot, RoundRecord, MAX_ROUND_RECORD_BYTES)
        if record is None:
            raise CoordinationError(f"round {rnd.number}'s closing record is gone or invalid")
        return tuple(record.node_ids())

    async def share_collectives(self, rnd: Round, mine: Collectives) -> None:
        slot = self._collectives_key(rnd)
        await self._call("share this node's collectives", lambda: self._kv.put(slot, mine))

    async def gather_collectives(self, rnd: Round) -> list[Collectives]:
        prefix = key(rnd.number, "collectives/")
        found = await gather_members(self._kv, prefix, Collectives, await self.roster(rnd))
        return list(found.values())

    async def decide_culprit(self, rnd: Round, culprit: JobCulprit) -> JobCulprit:
        slot = key(rnd.number, CULPRIT)
        decide = partial(self._kv.decide, slot, culprit, JobCulprit)
        return await self._call("decide the job's culprit", decide)

    async def await_culprit(
        self, rnd: Round, within_s: float, mine: Collectives | None = None
    ) -> JobCulprit | None:
        # Shared in the read's transaction, heard by the end's watch: one call per node (1,024
        # nodes do this at once, on a loaded store).
        shared = () if mine is None else (self._kv.put_op(self._collectives_key(rnd), mine),)
        return await self._ends.await_culprit(rnd.number, shared, within_s)

    def _collectives_key(self, rnd: Round) -> str:
        return key(rnd.number, f"collectives/{self.node_id}")

    # -- in-process restart ------------------------------------------------------------------

    async def inprocess_store(self) -> tuple[str, int]:
        """Where the ranks' in-process rounds meet: a TCPStore of node rank 0's daemon (kept
        for the daemon's life; each attempt's keys have their own prefix), its address
        published in etcd for the round. Not the round's workers' store: node rank 0 replaces
        that one for every in-process round after the first."""
        rnd = self.round
        assert rnd is not None
        slot = key(rnd.number, "inprocess")
        if rnd.group_rank == 0:
            if self._inprocess is None:
                self._inprocess = await TcpStoreServer.start(self.address)
            host, port = self.address, self._inprocess.port
            me = Member(node_id=self.node_id, addr=host, nproc=1, store_port=port)
            await self._call("publish the in-process store", lambda: self._kv.put(slot, me))
            return host, port
        leader = rnd.leader_id
        published = self._spawn(self._kv.await_decided(slot, Member), "member-published")
        ended = self.ended(rnd)
        timeout_s = self.config.rdzv_join_timeout_s
        found = await leaders_store(published, ended, leader, rnd.number, timeout_s)
        # None: the round ends anyway (its leader is gone): the attempt is stopped at once.
        return found or rnd.store_host


def create_etcd_coordinator(
    config: ServeConfig, secret: bytes | None, report: Report | None
) -> EtcdCoordinator:
    return EtcdCoordinator(config, secret, report or (lambda kind, data: None))
