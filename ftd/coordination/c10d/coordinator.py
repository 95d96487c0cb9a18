"""The c10d TCPStore coordinator: rounds, requests, the restart budget, exclusion, liveness.

Every key lives under `ftd/<rdzv id>/` (a PrefixStore), so jobs sharing a store never meet.
Only the store's atomic operations are used; there is no consensus of our own. Keys, `r<N>/...`
belonging to round N (a decided key is a chain `k`, `k#1`, ...: the first valid record wins):

  round                 a hint: the newest round (moved on with compare_set; never `add`ed)
  r<N>/joined           join counter: the n-th joiner writes r<N>/node/<n> (a Member record)
  r<N>/closed           decided RoundRecord: members in node-rank order, restarts used before,
                        excluded nodes (or `aborted`: the round could not form)
  r<N>/closed_delta     decided RoundDelta, by the closer after r<N>/closed: what round N-1's
                        members read instead (round_delta.py)
  r<N>/request          decided RequestRecord ending the round: restart, fail or succeed
  r<N>/succeeded/<node>, r<N>/unhealthy/<node>, r<N>/acked/<node>   a node's marks
  r<N>/succeeded-count, r<N>/unhealthy-count   how many marks of each were made (rounds.py:
                        a node reads two counts at the job's end, the last reads the marks)
  r<N>/respawns, r<N>/respawn/<k>   in-process respawns charged to the budget
  alive/<node>          AliveRecord, keepalive (liveness.py)
  status/<node>         NodeSummary for GET /v1/cluster
  r<N>/standby, r<N>/standby/<k>    the standbys waiting for round N's end (standby.py)
  excluded, excluded/<node>   the excluded nodes (ExcludedRecord) and one MarkRecord per node

Waits block in the store on connections of their own (store_connections.py); deadlines (last
call, join timeout) are the event loop's. The restart budget is carried in the signed round
records: round N+1's = round N's + its respawns + 1 if its request was a counted restart; a
daemon never accepts a count lower than one it has seen. A round costs O(N) store operations.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ftd.config.serve import ServeConfig
from ftd.coordination.base import CoordinationError, NodeLost, Round, RoundWaits, cluster_answer
from ftd.coordination.c10d.assigned import roster
from ftd.coordination.c10d.connections import StoreConnections
from ftd.coordination.c10d.liveness import Keepalive
from ftd.coordination.c10d.reach import reach_store
from ftd.coordination.c10d.record_store import RecordStore
from ftd.coordination.c10d.round_steps import StoreRoundSteps
from ftd.coordination.c10d.rounds import StoreRounds
from ftd.coordination.endpoint import parse_endpoint, route_address
from ftd.coordination.exclusion_ledger import Excluding
from ftd.coordination.job_culprit import gather_wait_s
from ftd.coordination.progress import Reaching
from ftd.coordination.records import (
    AGGREGATES,
    Collectives,
    JobCulprit,
    MarkRecord,
    Member,
    NodeSummary,
    RecordCodec,
    RequestRecord,
)
from ftd.coordination.round_rules import join
from ftd.coordination.shared_rounds import (
    key,
)
from ftd.tasks import within
from ftd.tcpstore.server import TcpStoreServer

log = logging.getLogger("ftd.rendezvous")


class StoreCoordinator:
    """One daemon's side of the job's membership over c10d's TCPStore."""

    def __init__(self, config: ServeConfig, secret: bytes | None) -> None:
        self.config = config
        self.node_id = config.node_id
        self.endpoint = parse_endpoint(config.rdzv_endpoint)
        self.codec = RecordCodec(config.run_id, secret)
        self.lost = asyncio.Event()
        self.lost_reason = ""
        self.round: Round | None = None
        self.excluded: dict[str, str] = {}
        self.hosting = False
        self.reached = False
        self.describe = f"store {self.endpoint[0]}:{self.endpoint[1]}"
        self._server: TcpStoreServer | None = None
        self._connections = StoreConnections(
            self.endpoint, self.prefix, self.codec, self._store_lost
        )
        self._keepalive: Keepalive | None = None
        self._keepalive_task: asyncio.Task[None] | None = None
        self._rounds = StoreRounds(config)
        self._steps: StoreRoundSteps | None = None

    @property
    def prefix(self) -> str:
        return f"ftd/{self.config.run_id}/"

    @property
    def ops(self) -> int:
        """Store operations sent by this daemon (all connections)."""
        return self._connections.ops

    @property
    def address(self) -> str:
        """The address the other nodes reach this node at."""
        return self.config.local_addr or self.config.master_addr or route_address(*self.endpoint)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, on_node_lost: NodeLost, waits: RoundWaits | None = None) -> None:
        """Host or reach the store (reach.py; a signal cancels it: the daemon races it against
        its stop); `waits` hears each try until it answers."""
        host, port = self.endpoint
        loop = asyncio.get_running_loop()
        reaching = Reaching(self.config.rdzv_endpoint, self.config.rdzv_join_timeout_s, waits)
        try:
            self._server, deadline = await reach_store(
                self.config, self.endpoint, self.describe, reaching
            )
            self.hosting = self._server is not None
            try:
                await within(self._connections.open(), max(5.0, deadline - loop.time()))
            except TimeoutError:
                raise CoordinationError(
                    f"the rendezvous store at {host}:{port} answered a probe but not c10d's "
                    "client within --rdzv-join-timeout",
                    "store_lost",
                ) from None
        finally:
            reaching.done()
        if not self.codec.signed:
            log.warning(
                "the rendezvous store at %s:%d is open: anyone who reaches it can end or "
                "redirect this job. Give every node the same secret (FTD_RDZV_SECRET or "
                "--rdzv-conf secret_file=PATH); see docs/security.md",
                host,
                port,
            )
        beats = self._connections.beats
        assert beats.store is not None
        self._keepalive = keepalive = Keepalive(
            self.node_id,
            beats.store,
            beats.thread,
            self.config.node_keepalive_timeout_s,
            on_node_lost,
            self._mark_lost,
        )
        await self._connections.call(lambda s: keepalive.beat_now())
        self.excluded = await self._connections.call(self._rounds.read_excluded)
        self._steps = StoreRoundSteps(self._connections, self._rounds, keepalive)
        self._keepalive_task = asyncio.create_task(self._keepalive.run(), name="ftd-keepalive")
        self.reached = True

    async def close(self) -> None:
        self._rounds.closing = True
        if self._keepalive is not None:
            self._keepalive.stop()
        if self._keepalive_task is not None:
            self._keepalive_task.cancel()
            await asyncio.gather(self._keepalive_task, return_exceptions=True)
        if not self.lost.is_set() and self._keepalive is not None and not self._keepalive.done:
            self._keepalive.done = True
            try:  # leaving: not dead, so nobody waits a keepalive timeout for this node
                beats = self._connections.beats
                await within(beats.thread.submit(self._keepalive.beat_now), 2)
            except Exception:
                log.debug("could not mark this node done", exc_info=True)
        self._connections.close()
        server, self._server = self._server, None
        if server is not None:
            await server.close()

    def finishing(self) -> None:
        """The job is over for this node: a store that goes away now is no loss."""
        self._rounds.closing = True
        if self._keepalive is not None:
            self._keepalive.done = True

    def _mark_lost(self, why: str) -> None:
        if not self.lost.is_set() and not self._rounds.closing:
            host, port = self.endpoint
            self.lost_reason = f"store lost: the rendezvous store at {host}:{port} is gone ({why})"
            log.error("%s", self.lost_reason)
            self.lost.set()

    def _store_lost(self, why: str) -> CoordinationError:
        """A store call failed (`why`): the store is lost, unless this daemon is closing."""
        self._mark_lost(why)
        return CoordinationError(self.lost_reason or "store lost", "store_lost")

    # -- rounds ------------------------------------------------------------------------------

    async def join(self, me: Member, waits: RoundWaits | None = None) -> Round:
        assert self._steps is not None
        deadline = asyncio.get_running_loop().time() + self.config.rdzv_join_timeout_s
        self.round = await join(
            self.config, self._steps, me, deadline, self.round, waits, self._learn
        )
        return self.round

    def _learn(self, record: Excluding) -> None:
        self.excluded = dict(record.excluded)

    # -- the round's end ---------------------------------------------------------------------

    def ended(self, rnd: Round) -> asyncio.Future[RequestRecord]:
        future: asyncio.Future[RequestRecord] = asyncio.ensure_future(
            self._connections.wait_decided(
                self._rounds.await_request,
                self._rounds.request_now,
                rnd.number,
                key(rnd.number, "request"),
                "its request",
            )
        )
        # A lost store is also reported through `lost`, which the loop may see first.
        future.add_done_callback(lambda done: done.cancelled() or done.exception())
        return future

    async def request(self, rnd: Round, request: RequestRecord) -> RequestRecord:
        decided = await self._connections.call(self._rounds.decide_request, rnd.number, request)
        if decided == request:
            log.info("round %d: requested %s: %s", rnd.number, request.action, request.reason)
        return decided

    async def restarts_used(self, rnd: Round) -> int:
        return rnd.restarts + await self._connections.call(self._rounds.respawns, rnd.number)

    async def count_restart(self, rnd: Round, reason: str) -> int:
        def charge(s: RecordStore) -> int:
            k = s.count(key(rnd.number, "respawns"), 1, lambda: 0)
            s.put(
                key(rnd.number, f"respawn/{k}"),
                MarkRecord(node_id=self.node_id, reason=reason[:4000]),
            )
            return rnd.restarts + self._rounds.respawns(s, rnd.number)

        return await self._connections.call(charge)

    async def succeeded(self, rnd: Round) -> None:
        await self._connections.call(self._rounds.mark_succeeded, rnd)

    async def unhealthy(self, rnd: Round, node_id: str) -> int:
        return await self._connections.call(self._rounds.mark_unhealthy, rnd, node_id)

    async def leave(self, rnd: Round) -> None:
        """Acknowledge the end of the job; the store's host waits (bounded) for every member's
        acknowledgement before it takes the store away."""

        def ack(s: RecordStore) -> None:
            s.put(key(rnd.number, f"acked/{self.node_id}"), MarkRecord(node_id=self.node_id))
            if self.hosting:
                keys = [key(rnd.number, f"acked/{n}") for n in roster(s, rnd)]
                s.wait(keys, self.config.node_keepalive_timeout_s * 2)

        try:
            await self._connections.call(ack, timeout_s=self.config.node_keepalive_timeout_s * 3)
        except CoordinationError:
            log.debug("could not acknowledge the end of the job", exc_info=True)
        self.finishing()

    # -- exclusion ---------------------------------------------------------------------------

    async def exclude(self, node_id: str, reason: str) -> None:
        self.excluded = await self._connections.call(self._rounds.update_excluded, node_id, reason)

    def readmitting(self, node_id: str) -> bool:
        return self.excluded.pop(node_id, None) is not None

    async def readmit(self, node_id: str) -> None:
        self.excluded = await self._connections.call(self._rounds.update_excluded, node_id, None)

    # -- status ------------------------------------------------------------------------------

    async def publish_status(self, summary: dict[str, Any]) -> None:
        record = NodeSummary.model_validate(summary)
        await self._connections.call(lambda s: s.put(f"status/{self.node_id}", record))

    async def publish_aggregate(self, name: str, values: dict[str, Any]) -> None:
        record = AGGREGATES[name].model_validate(values)
        await self._connections.call(lambda s: s.put(f"aggregate/{name}", record))

    async def aggregate(self, name: str) -> dict[str, Any] | None:
        model = AGGREGATES[name]
        found = await self._connections.call(lambda s: s.peek(f"aggregate/{name}", model))
        return found.model_dump() if found is not None else None

    async def summary_of(self, node_id: str) -> dict[str, Any] | None:
        found = await self._connections.call(lambda s: s.peek(f"status/{node_id}", NodeSummary))
        return found.model_dump() if found is not None else None

    async def cluster(self) -> dict[str, Any]:
        rnd = self.round
        view = await self._connections.call(self._rounds.cluster_view, rnd)
        nodes, self.excluded, members = view
        refused = dict(self.codec.refused)
        return cluster_answer(nodes, rnd, self.excluded, self.ops, refused, members=members)

    # -- the job's culprit of a hang (job_culprit.py) ----------------------------------------

    async def share_collectives(self, rnd: Round, mine: Collectives) -> None:
        slot = key(rnd.number, f"collectives/{self.node_id}")
        shared = key(rnd.number, "collectives_shared")  # node rank 0 sees shares coming

        def share(s: RecordStore) -> None:
            s.put(slot, mine)
            s.count(shared, 1, lambda: 0)

        await self._connections.call(share)

    async def roster(self, rnd: Round) -> tuple[str, ...]:
        return await self._connections.call(roster, rnd)

    async def gather_collectives(self, rnd: Round) -> list[Collectives]:
        slots = {key(rnd.number, f"collectives/{n}"): n for n in await self.roster(rnd)}
        shared = key(rnd.number, "collectives_shared")

        def gather(s: RecordStore) -> list[Collectives]:
            keys = list(slots)
            since = last_news = time.monotonic()
            heard = s.count(shared, 0, lambda: 0)
            # Every node's, or those there once none came for a while (one count a while).
            while left := gather_wait_s(since, last_news, time.monotonic()):
                if s.wait(keys, left):
                    break
                now = s.count(shared, 0, lambda: 0)
                if now != heard:
                    heard, last_news = now, time.monotonic()
            found = s.read_many(keys, Collectives)
            return [c for k, c in found.items() if c.node_id == slots[k]]

        return await self._connections.wait(gather)

    async def decide_culprit(self, rnd: Round, culprit: JobCulprit) -> JobCulprit:
        slot = key(rnd.number, "culprit")
        return await self._connections.call(lambda s: s.decide(slot, culprit, JobCulprit))

    async def await_culprit(
        self, rnd: Round, within_s: float, mine: Collectives | None = None
    ) -> JobCulprit | None:
        if mine is not None:
            await self.share_collectives(rnd, mine)
        slot = key(rnd.number, "culprit")

        def decided(s: RecordStore) -> JobCulprit | None:
            return s.decided(slot, JobCulprit) if s.wait([slot], within_s) else None

        return await self._connections.wait(decided)

    async def inprocess_store(self) -> tuple[str, int]:
        return self.endpoint
