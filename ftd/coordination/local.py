"""The coordinator of a one-node job (`--standalone`, `--nnodes 1`): no store, all in memory.

Rounds are attempts: round N is the N-th attempt (TORCHELASTIC_RESTART_COUNT), its one member
is this node, and its request is decided in memory, so the attempt loop is the same as on many
nodes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ftd.coordination.base import NodeLost, Round, RoundWaits, new_request
from ftd.coordination.records import (
    Collectives,
    JobCulprit,
    Member,
    RecordCodec,
    RequestRecord,
    RoundMember,
)
from ftd.tcpstore.server import TcpStoreServer

log = logging.getLogger("ftd.coordination.local")


class LocalCoordinator:
    def __init__(self, node_id: str, store_host: str = "127.0.0.1") -> None:
        self.node_id = node_id
        self.lost = asyncio.Event()
        self.lost_reason = ""
        self.round: Round | None = None
        self.excluded: dict[str, str] = {}
        self.describe = "this node alone (no rendezvous store)"
        self.reached = True
        self.hosting = False
        self.codec: RecordCodec | None = None  # no record leaves this node
        self.address = store_host
        self._next = 0
        self._restarts = 0
        self._requests: dict[int, asyncio.Future[RequestRecord]] = {}
        self._store_host = store_host
        self._inprocess: TcpStoreServer | None = None
        self._collectives: dict[int, Collectives] = {}
        self._culprits: dict[int, JobCulprit] = {}

    async def start(self, on_node_lost: NodeLost, waits: RoundWaits | None = None) -> None:
        pass

    async def close(self) -> None:
        store, self._inprocess = self._inprocess, None
        if store is not None:
            await store.close()

    async def join(self, me: Member, waits: RoundWaits | None = None) -> Round:
        number, self._next = self._next, self._next + 1
        self.round = Round.of_members(number, (RoundMember.of(me),), self._restarts, 0, {})
        return self.round

    def _future(self, rnd: Round) -> asyncio.Future[RequestRecord]:
        future = self._requests.get(rnd.number)
        if future is None:
            future = self._requests[rnd.number] = asyncio.get_running_loop().create_future()
            self._requests.pop(rnd.number - 2, None)  # nobody waits for older rounds
        return future

    def ended(self, rnd: Round) -> asyncio.Future[RequestRecord]:
        return self._future(rnd)

    async def request(self, rnd: Round, request: RequestRecord) -> RequestRecord:
        future = self._future(rnd)
        if not future.done():
            future.set_result(request)
            if request.action == "restart" and request.counted:
                self._restarts += 1
        return future.result()

    async def restarts_used(self, rnd: Round) -> int:
        return self._restarts

    async def roster(self, rnd: Round) -> tuple[str, ...]:
        return rnd.node_ids or (rnd.leader_id,)

    async def count_restart(self, rnd: Round, reason: str) -> int:
        self._restarts += 1
        return self._restarts

    async def succeeded(self, rnd: Round) -> None:
        await self.request(rnd, new_request("succeed", "every rank exited 0", self.node_id))

    async def unhealthy(self, rnd: Round, node_id: str) -> int:
        return 0

    async def leave(self, rnd: Round) -> None:
        pass

    async def exclude(self, node_id: str, reason: str) -> None:
        raise AssertionError("a one-node job has nothing to exclude")

    def readmitting(self, node_id: str) -> bool:
        return self.excluded.pop(node_id, None) is not None

    async def readmit(self, node_id: str) -> None:
        raise AssertionError("a one-node job has nothing to readmit")

    async def publish_status(self, summary: dict[str, Any]) -> None:
        pass

    async def publish_aggregate(self, name: str, values: dict[str, Any]) -> None:
        pass

    async def aggregate(self, name: str) -> dict[str, Any] | None:
        return None  # one node is the whole job

    async def summary_of(self, node_id: str) -> dict[str, Any] | None:
        return None

    async def cluster(self) -> dict[str, Any]:
        raise AssertionError("a one-node job's cluster is its own status")

    async def share_collectives(self, rnd: Round, mine: Collectives) -> None:
        self._collectives = {rnd.number: mine}

    async def gather_collectives(self, rnd: Round) -> list[Collectives]:
        found = self._collectives.get(rnd.number)
        return [found] if found is not None else []

    async def decide_culprit(self, rnd: Round, culprit: JobCulprit) -> JobCulprit:
        if self._culprits.get(rnd.number) is None:
            self._culprits = {rnd.number: culprit}
        return self._culprits[rnd.number]

    async def await_culprit(
        self, rnd: Round, within_s: float, mine: Collectives | None = None
    ) -> JobCulprit | None:
        if mine is not None:
            await self.share_collectives(rnd, mine)
        return self._culprits.get(rnd.number)  # decided before: this node is node rank 0

    async def inprocess_store(self) -> tuple[str, int]:
        """A store of this daemon's for the ranks' in-process rounds, made on first use."""
        if self._inprocess is None:
            self._inprocess = await TcpStoreServer.start(self._store_host)
        return self._store_host, self._inprocess.port
