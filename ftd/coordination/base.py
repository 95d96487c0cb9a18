"""The seam between the attempt loop and the cluster: one `Coordinator` per daemon.

The daemon's loop is the same on one node and on many: join a round, start the attempt, wait
for the first outcome, decide, publish one request for the round, stop, join the next. What
differs between backends (in memory for one node, c10d's TCPStore, etcd) lives behind this
protocol, chosen by `--rdzv-backend` like torchelastic's rendezvous handlers.

Rules every implementation keeps:
- one request ends a round, decided once for every node (the first valid one wins);
- restarts are counted in one place, from signed records (a raw write changes nothing);
- everything read from the backend is parsed and verified (records.py) before use;
- a lost backend sets `lost` (with `lost_reason`) and fails the calls in flight with
  CoordinationError(code="store_lost"); it never raises into a task that does not await it.
"""

from __future__ import annotations

import asyncio
import bisect
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, Protocol

from ftd.coordination.records import (
    Collectives,
    JobCulprit,
    Member,
    MemberRow,
    RecordCodec,
    RequestRecord,
    RoundMember,
)
from ftd.status.model import Connecting, Standby, Waiting

ErrorCode = Literal["failed", "excluded", "store_lost", "stopped", "succeed", "fail"]
NodeLost = Callable[[str, str], None]
"""(node id, reason): a member stopped answering; the loop decides what to do."""
Report = Callable[[str, Mapping[str, Any]], object]
"""(event kind, data): what a backend wants in the daemon's event log."""


class RoundWaits(Protocol):
    """What this node waits for while it joins a round, told as it is seen (the board's)."""

    def standby(self, wait: Standby) -> None:
        """It found a round full: it waits for its end as a standby (coordination/standby.py)."""
        ...

    def waiting(self, wait: Waiting | None) -> None:
        """It waits in a forming round for others to join (coordination/progress.py); None
        once that wait is over."""
        ...

    def connecting(self, reach: Connecting | None) -> None:
        """It reaches for the rendezvous endpoint before any round (coordination/progress.py):
        each failed try; None once it did or gave up."""
        ...


@dataclass(frozen=True)
class Placement:
    """Where this node's ranks sit in the world for one attempt (from the rendezvous)."""

    group_rank: int
    group_world_size: int
    base_global_rank: int
    world_size: int
    master_addr: str
    master_port: int


class CoordinationError(Exception):
    """The node cannot take part in the job any more; `reason` says why (shown as is)."""

    def __init__(self, reason: str, code: ErrorCode = "failed") -> None:
        super().__init__(reason)
        self.reason = reason
        self.code: ErrorCode = code


@dataclass(frozen=True)
class Round:
    """A round as this node holds it: its own place in it, node rank 0's row and its replicas'
    successor; `members`, the whole list, only where this node read the closing record (node
    rank 0 always; see assignment.py). `roster` (the coordinator's) reads the list elsewhere."""

    number: int
    restarts: int
    """Restarts used before this round (the budget is counted across the cluster)."""
    group_rank: int
    excluded: Mapping[str, str]
    size: int
    """The members (the group world size)."""
    leader: MemberRow
    """Node rank 0's row."""
    nproc: int
    """This node's ranks in this round."""
    base_global_rank: int
    world_size: int
    successor: str | None
    """The next member in the replicas' ring (node ids in order); None alone."""
    members: tuple[MemberRow, ...] | None = None

    @classmethod
    def of_members(
        cls,
        number: int,
        members: tuple[MemberRow, ...],
        restarts: int,
        group_rank: int,
        excluded: Mapping[str, str],
    ) -> Round:
        """The round from its whole list (the closing record, or one node alone)."""
        nprocs = [row[2] for row in members]  # RoundMember.nproc
        successor = ring_successor(sorted({row[0] for row in members}), members[group_rank][0])
        return cls(
            number=number,
            restarts=restarts,
            group_rank=group_rank,
            excluded=excluded,
            size=len(members),
            leader=members[0],
            nproc=nprocs[group_rank],
            base_global_rank=sum(nprocs[:group_rank]),
            world_size=sum(nprocs),
            successor=successor,
            members=members,
        )

    @cached_property
    def node_ids(self) -> tuple[str, ...] | None:
        """The members' ids, where this node holds the list (computed once a round)."""
        return None if self.members is None else tuple(row[0] for row in self.members)

    @property
    def leader_id(self) -> str:
        return self.leader[0]

    @property
    def store_host(self) -> tuple[str, int]:
        """Where this round's workers' store listens: node rank 0's, ready before it joined."""
        first = RoundMember._make(self.leader)
        return first.addr, first.store_port

    def placement(self) -> Placement:
        host, port = self.store_host
        return Placement(
            group_rank=self.group_rank,
            group_world_size=self.size,
            base_global_rank=self.base_global_rank,
            world_size=self.world_size,
            master_addr=host,
            master_port=port,
        )


def ring_successor(ring: list[str], me: str) -> str | None:
    """The node after `me` in the replicas' ring (`ring`: the members' ids, sorted); None
    alone."""
    if len(ring) < 2:
        return None
    return ring[(bisect.bisect_left(ring, me) + 1) % len(ring)]


def new_request(
    action: Literal["restart", "fail", "succeed"],
    reason: str,
    by: str,
    counted: bool = False,
    exit_code: int = 1,
    hang: bool = False,
) -> RequestRecord:
    return RequestRecord(
        action=action,
        reason=reason[:4000],
        by=by,
        counted=counted,
        nonce=uuid.uuid4().hex,
        exit_code=exit_code,
        hang=hang,
    )


def order_members(joined: list[Member], previous: list[str]) -> list[RoundMember]:
    """Node ranks: nodes with the scheduler's rank (`order`) first, in its order; then nodes of
    the previous round in theirs, newcomers following by id; a node id joins once per round
    (the first record wins)."""
    unique: dict[str, Member] = {}
    for member in joined:
        unique.setdefault(member.node_id, member)
    rank = {node: i for i, node in enumerate(previous)}

    def key(m: Member) -> tuple[int, int, str]:
        if m.order is not None:
            return (0, m.order, m.node_id)
        return (1, rank.get(m.node_id, len(rank)), m.node_id)

    return [RoundMember.of(m) for m in sorted(unique.values(), key=key)]


class Coordinator(Protocol):
    """One daemon's view of the job's membership; the attempt loop drives it round by round."""

    lost: asyncio.Event
    lost_reason: str
    round: Round | None
    excluded: dict[str, str]
    """Excluded nodes (node id → reason) as last seen."""
    describe: str
    """Where the cluster meets, for the start-up log line."""
    reached: bool
    """Whether `start` reached the backend (nothing is read from it before)."""

    @property
    def address(self) -> str:
        """The address other nodes reach this node at (its workers' store listens there)."""
        ...

    @property
    def codec(self) -> RecordCodec | None:
        """The job's records' signer (its keys seal in-process rounds and replicas); None
        where nothing is written for other nodes (one node alone)."""
        ...

    @property
    def hosting(self) -> bool:
        """Whether this daemon hosts the rendezvous store (said at start)."""
        ...

    async def start(self, on_node_lost: NodeLost, waits: RoundWaits | None = None) -> None:
        """Connect (host what this node hosts), start liveness; CoordinationError when the
        backend cannot be reached. `waits` hears each failed try while it reaches for it."""
        ...

    async def close(self) -> None: ...

    async def join(self, me: Member, waits: RoundWaits | None = None) -> Round:
        """Join the next round; returns once it closed with this node in it. CoordinationError:
        excluded, too few nodes within the join timeout, the job is over, the backend lost.
        `waits` (the board's) hears what this node waits for: a full round's end as a standby
        (it is one no more once a round is joined), others to join a round that forms."""
        ...

    def ended(self, rnd: Round) -> asyncio.Future[RequestRecord]:
        """Resolves with the request that ends `rnd`, the moment it is made (no polling)."""
        ...

    async def request(self, rnd: Round, request: RequestRecord) -> RequestRecord:
        """Make `request` end `rnd` unless another came first: the one in force. A counted
        restart is charged to the budget by being the round's request."""
        ...

    async def restarts_used(self, rnd: Round) -> int: ...

    async def roster(self, rnd: Round) -> tuple[str, ...]:
        """`rnd`'s members' ids: the list this node holds, else read from the closing record
        (O(N): for an operator's view or the job's end, never once a round on every node)."""
        ...

    async def count_restart(self, rnd: Round, reason: str) -> int:
        """Charge one restart that ends no round (an in-process respawn): the restarts used,
        this one included."""
        ...

    async def succeeded(self, rnd: Round) -> None:
        """This node's ranks all exited 0; once every healthy member has, the round's request
        is `succeed` (torchrun's exit barrier: a failure elsewhere still restarts this node)."""
        ...

    async def unhealthy(self, rnd: Round, node_id: str) -> int:
        """--restart-policy min-healthy: mark `node_id` unhealthy; the healthy members left."""
        ...

    async def leave(self, rnd: Round) -> None:
        """The job is over for this node: acknowledge it (bounded)."""
        ...

    async def exclude(self, node_id: str, reason: str) -> None: ...

    def readmitting(self, node_id: str) -> bool:
        """Take `node_id` off the excluded nodes now (the store follows with `readmit`);
        whether it was excluded."""
        ...

    async def readmit(self, node_id: str) -> None: ...

    async def publish_status(self, summary: dict[str, Any]) -> None: ...

    async def publish_aggregate(self, name: str, values: dict[str, Any]) -> None:
        """What the round's node rank 0 gathered from every summary (records.AGGREGATES)."""

    async def aggregate(self, name: str) -> dict[str, Any] | None:
        """The aggregate `name` as node rank 0 last wrote it (None: not yet, or invalid)."""
        ...

    async def summary_of(self, node_id: str) -> dict[str, Any] | None:
        """One node's published summary (None: none, or invalid)."""
        ...

    async def cluster(self) -> dict[str, Any]:
        """Every member's summary, the round, the excluded nodes (GET /v1/cluster)."""
        ...

    async def share_collectives(self, rnd: Round, mine: Collectives) -> None:
        """This node's ranks' collectives as `rnd`'s attempt ended on a hang (job_culprit.py)."""
        ...

    async def gather_collectives(self, rnd: Round) -> list[Collectives]:
        """Node rank 0: every member's shared collectives, or those shared until none came for
        a while (job_culprit.gather_wait_s)."""
        ...

    async def decide_culprit(self, rnd: Round, culprit: JobCulprit) -> JobCulprit:
        """Make `culprit` `rnd`'s unless one was decided first: the one in force."""
        ...

    async def await_culprit(
        self, rnd: Round, within_s: float, mine: Collectives | None = None
    ) -> JobCulprit | None:
        """`rnd`'s decided culprit once there is one (a blocking wait or a watch), or None
        after `within_s`; `mine`: this node's collectives, shared first (etcd: in the call
        that reads the decision)."""
        ...

    def inprocess_store(self) -> Awaitable[tuple[str, int]]:
        """Where ranks' in-process rounds meet (a TCPStore this daemon can reach)."""
        ...


def cluster_answer(
    nodes: list[dict[str, Any]],
    rnd: Round | None,
    excluded: dict[str, str],
    store_ops: int,
    refused: dict[str, int],
    unavailable: str | None = None,
    members: Sequence[str] | None = None,
) -> dict[str, Any]:
    """`GET /v1/cluster`'s answer, the same from every backend (`members`: `rnd`'s, where
    this node holds no list)."""
    if members is None:
        members = (rnd.node_ids or ()) if rnd else ()
    answer: dict[str, Any] = {
        "nodes": nodes,
        "round": {"round": rnd.number if rnd else 0, "members": list(members)},
        "excluded": [{"node_id": n, "reason": r} for n, r in sorted(excluded.items())],
        "stragglers": [
            {"node_id": node.get("node_id"), **straggler}
            for node in nodes
            for straggler in node.get("stragglers", ())
        ],
        "store_ops": store_ops,
        "refused_records": refused,
    }
    if unavailable is not None:
        answer["unavailable"] = unavailable
    return answer
