"""What daemons write for each other: typed, bounded records, signed with the job's secret.

Anyone who can reach the rendezvous store can write to it. So every value a daemon reads there
is parsed into one of the records below (bounds on every field) and, when the job has a secret
(`--rdzv-conf secret_file=PATH` or FTD_RDZV_SECRET, the same on every node), verified: a record
carries an HMAC-SHA256 over (rdzv id, key, value). The key names the round (`r5/request`), so a
record replayed into another key, round or job fails. A record that fails to parse or verify is
logged once with its key and ignored: never acted on, never an exception in a task.

Wire form, one line: `ftd1 <hex mac or -> <body>`, the body the record's JSON or, where that is
long, the JSON packed (record_body.py); the MAC covers the body as stored.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections import Counter
from typing import Annotated, Literal, NamedTuple, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from ftd.coordination.record_body import BodyRefused, pack, unpack
from ftd.refusals import Refusals

log = logging.getLogger("ftd.coordination.records")

MAGIC = "ftd1"
UNSIGNED = "-"
MAX_RECORD_BYTES = 64 * 1024
MAX_ROUND_RECORD_BYTES = 32 * 1024 * 1024
"""A round of 100k nodes at ~150 bytes a member."""
MAX_NODES = 100_000
MAX_LOGGED = 1024

NodeId = Annotated[
    str, StringConstraints(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9][A-Za-z0-9._@:+-]*$")
]
"""A node's name; it appears in store keys, file names and logs."""
HostName = Annotated[
    str, StringConstraints(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9._:%\[\]-]+$")
]
Reason = Annotated[str, StringConstraints(max_length=4000)]
RoundNumber = Annotated[int, Field(ge=0, lt=2**31)]
Count = Annotated[int, Field(ge=0, lt=2**31)]
NodeRanks = Annotated[int, Field(ge=1, le=65536)]
Port = Annotated[int, Field(ge=1, le=65535)]
SchedulerRank = Annotated[int, Field(ge=0, lt=2**20)]


class Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class Member(Record):
    """A node in a round, as it joined: where it is, how many ranks, and the workers' store it
    has ready (used when it becomes node rank 0)."""

    node_id: NodeId
    addr: HostName
    nproc: NodeRanks
    store_port: Port
    order: SchedulerRank | None = None
    """The scheduler's rank of the node (--node-rank), where it has one."""


MemberRow = tuple[NodeId, HostName, NodeRanks, Port, SchedulerRank | None]
"""A member as its round's record carries it: a Member's fields in their order (RoundMember
names them), one JSON array. Every node reads its round's record, N members long: as arrays of
plain tuples, validated by pydantic alone with no Python call per member, it is ~half the bytes
and a quarter of the decoding of Member objects (0.30 against 1.18 ms at 1,024 members; under
load, the Python calls were most of it: bench/SCALE.md). Each field bounded as a Member's."""


class RoundMember(NamedTuple):
    """A MemberRow's fields by name."""

    node_id: str
    addr: str
    nproc: int
    store_port: int
    order: int | None = None

    @classmethod
    def of(cls, member: Member) -> RoundMember:
        return cls(member.node_id, member.addr, member.nproc, member.store_port, member.order)


class RoundRecord(Record):
    """A closed round: its members in node-rank order, the restarts used before it, the
    nodes excluded when it closed. `aborted` closes a round that could not form."""

    number: RoundNumber
    members: tuple[MemberRow, ...] = Field(max_length=MAX_NODES)
    restarts: Count
    excluded: dict[NodeId, Reason] = Field(default_factory=dict, max_length=MAX_NODES)
    aborted: Reason | None = None
    excluded_epoch: Count = 0
    """The epoch of `excluded` (ExcludedRecord.epoch): bound to this round's key, so a replayed
    `excluded` record cannot take a node's exclusion back past it."""

    def node_ids(self) -> list[str]:
        return [row[0] for row in self.members]


class RequestRecord(Record):
    """What ends a round for every node: `restart`, `fail` or `succeed`, and why."""

    action: Literal["restart", "fail", "succeed"]
    reason: Reason
    by: NodeId
    counted: bool = False
    nonce: Annotated[str, StringConstraints(max_length=64)] = ""
    exit_code: int = Field(1, ge=1, le=255)
    """A `fail`'s exit code on every node: 1, or --ft-no-restart-exit-code where restarting
    cannot help (ftd/supervision/no_progress.py)."""
    hang: bool = False
    """The attempt ended on a hang verdict: every node shares its ranks' collectives and the
    job's culprit is decided (ftd/coordination/job_culprit.py)."""


class AliveRecord(Record):
    """A node's keepalive: `seq` grows with every beat; `done` once it has finished."""

    seq: int = Field(ge=0, lt=2**62)
    done: bool = False


class MarkRecord(Record):
    """A node's mark in a round: it succeeded, it is unhealthy, it respawned a rank."""

    node_id: NodeId
    reason: Reason = ""


class ExcludedRecord(Record):
    nodes: dict[NodeId, Reason] = Field(default_factory=dict, max_length=MAX_NODES)
    epoch: Count = 0
    """Grows by one with every exclusion and readmission."""


MAX_PUBLISHED_RANKS = 512
"""A node publishes the forward times and stragglers of at most this many of its ranks (its
summary stays far under MAX_RECORD_BYTES; nodes have 8 ranks, rarely 64)."""


Micros = Annotated[int, Field(ge=0, lt=2**40)]


class RankForward(Record):
    """A rank's median times per step (ftd/health/stragglers.py), for the job's medians: its
    forward pass and its host time (None: the rank does not report it)."""

    global_rank: Count
    forward_us: Micros | None = None
    host_us: Micros | None = None


ForwardRow = tuple[Count, Micros | None, Micros | None]
"""A RankForward as JobTimes carries it, one JSON array: validated by pydantic with no Python
object per rank (every node reads 512 every 5 s: 0.1 against 0.7 ms, bench/SCALE.md)."""


class RankStraggler(Record):
    global_rank: Count
    ratio: float = Field(ge=0, le=1e9, allow_inf_nan=False)
    since: float = Field(ge=0, allow_inf_nan=False)
    signal: Literal["forward", "host"] = "forward"


MAX_REPLICATED_STEPS = 16


class NodeSummary(Record):
    """What a node publishes for `GET /v1/cluster` on any node."""

    node_id: NodeId
    state: Annotated[str, StringConstraints(max_length=32)]
    attempt: Count
    restart_count: Count
    group_rank: Count | None
    round: Count | None = None
    nproc_per_node: int = Field(ge=1, le=65536)
    ranks_running: int = Field(0, ge=0, le=65536)
    ranks_total: int = Field(0, ge=0, le=65536)
    last_failure: Reason | None = None
    time: float = Field(ge=0, allow_inf_nan=False)
    forward: tuple[RankForward, ...] = Field((), max_length=MAX_PUBLISHED_RANKS)
    stragglers: tuple[RankStraggler, ...] = Field((), max_length=MAX_PUBLISHED_RANKS)
    replica_addr: HostName | None = None
    """host:port of the node's replica server (ftd/checkpoint/replication.py), when it has one."""
    replicated_steps: tuple[Annotated[int, Field(ge=0, le=2**53)], ...] = Field(
        (), max_length=MAX_REPLICATED_STEPS
    )
    """The newest steps whose snapshots of all the node's ranks its successor acknowledged."""
    replicated_round: Count | None = None
    """The round of those steps (another round's may be of another history)."""


class JobTimes(Record):
    """The job's ranks' times per step, gathered by the round's node rank 0 from every node's
    summary and written once: what each node judges its stragglers against, read in one get
    rather than from every node (ftd/health/job_times.py; at most MAX_PUBLISHED_RANKS ranks)."""

    round: Count
    time: float = Field(ge=0, allow_inf_nan=False)
    forward: tuple[ForwardRow, ...] = Field((), max_length=MAX_PUBLISHED_RANKS)


class NodeStep(Record):
    node_id: NodeId
    step: int = Field(ge=0, le=2**53)


class ReplicaFloor(Record):
    """What every node needs of the others' replicas (ftd/checkpoint/ledger.py, `replica_floor`:
    the oldest of the other nodes' second-newest acknowledged steps), gathered by the round's
    node rank 0 from every summary and written once: the two lowest second-newest steps with
    their nodes, and up to two nodes that have not said two steps yet. Enough for any node to
    take its own out: constant in size whatever the job's."""

    round: Count
    time: float = Field(ge=0, allow_inf_nan=False)
    lowest: tuple[NodeStep, ...] = Field((), max_length=2)
    short: tuple[NodeId, ...] = Field((), max_length=2)


class Collectives(Record):
    """One node's ranks as an attempt that ended on a hang left them: the fewest collectives a
    rank of it had entered, that rank, since when (wall time) it had made no progress, and how
    many of its ranks had entered more (they wait on it). Written once per node and round."""

    round: Count
    node_id: NodeId
    group_rank: Count
    lowest: Count | None
    """None: no rank of the node reported the collectives it entered."""
    rank: Count | None
    since: float | None = Field(None, ge=0, allow_inf_nan=False)
    waiting: Count = 0
    ranks: Count = 0
    judged: bool = False
    """This node's own verdict ended the attempt."""


class JobCulprit(Record):
    """The job's culprit of a hang, decided once per round by its node rank 0 from every
    node's Collectives: the node and rank the others wait on."""

    round: Count
    node_id: NodeId
    group_rank: Count
    rank: Count
    entered: Count
    waiting_nodes: Count
    """Nodes with a rank past `entered`: they wait on the culprit."""
    nodes: Count
    """The nodes whose Collectives the decision read."""
    reason: Reason
    time: float = Field(ge=0, allow_inf_nan=False)


AGGREGATES: dict[str, type[Record]] = {"job_times": JobTimes, "replica_floor": ReplicaFloor}
"""What node rank 0 gathers from every node's summary and writes once, by name, so that no
node reads every other's (issue 43)."""

R = TypeVar("R", bound=Record)


class RecordCodec:
    """Encodes and verifies records for one job; counts what it refused."""

    def __init__(self, rdzv_id: str, secret: bytes | None) -> None:
        self._rdzv_id = rdzv_id.encode()
        self._secret = secret
        self.refused: Counter[str] = Refusals("rendezvous_store")
        self._logged: set[tuple[str, str]] = set()

    @property
    def signed(self) -> bool:
        return self._secret is not None

    def inprocess_key(self, prefix: str) -> bytes | None:
        """The key that seals one attempt's in-process rounds (its ranks hold it, never the
        job secret); None when the job has no secret."""
        from ftd_client.inprocess.keys import derive_key

        return derive_key(self._secret, prefix) if self._secret is not None else None

    def replica_key(self) -> bytes | None:
        """The key of the frames that replicate snapshots between daemons
        (ftd/checkpoint/replica_frame.py): the job secret's, for this job and that use alone;
        None when the job has no secret."""
        if self._secret is None:
            return None
        label = b"ftd replica\0" + self._rdzv_id
        return hmac.new(self._secret, label, hashlib.sha256).digest()

    def _mac(self, key: str, body: bytes) -> str:
        assert self._secret is not None
        message = b"\0".join((self._rdzv_id, key.encode(), body))
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def encode(self, key: str, record: Record) -> str:
        body = pack(record.model_dump_json().encode())
        mac = self._mac(key, body) if self._secret is not None else UNSIGNED
        return f"{MAGIC} {mac} {body.decode()}"

    def decode(
        self, key: str, raw: bytes | str, model: type[R], max_bytes: int = MAX_RECORD_BYTES
    ) -> R | None:
        """The record at `key`, or None (logged once per key and cause) when it is not one."""
        data = raw.encode() if isinstance(raw, str) else bytes(raw)
        if len(data) > max_bytes:
            self._refuse(key, "oversized", f"{len(data)} bytes > {max_bytes}")
            return None
        magic, _, rest = data.partition(b" ")
        mac, _, body = rest.partition(b" ")
        if magic != MAGIC.encode() or not mac or not body:
            self._refuse(key, "malformed", "not an ftd record")
            return None
        if self._secret is not None:
            if mac == UNSIGNED.encode():
                self._refuse(key, "unsigned", "not signed, and this job has a secret")
                return None
            if not hmac.compare_digest(mac, self._mac(key, body).encode()):
                self._refuse(
                    key,
                    "bad_signature",
                    "signature does not match: forged, replayed from another key or round, "
                    "or the nodes' secrets (FTD_RDZV_SECRET / secret_file) differ",
                )
                return None
        if isinstance(plain := unpack(body, max_bytes), BodyRefused):
            self._refuse(key, plain.cause, plain.detail)
            return None
        try:
            return model.model_validate_json(plain)
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "record"
            self._refuse(key, "invalid", f"{where}: {first['msg']}")
            return None

    def refuse(self, key: str, cause: str, detail: str) -> None:
        self._refuse(key, cause, detail)

    def _refuse(self, key: str, cause: str, detail: str) -> None:
        """Count and log (once per key and cause)."""
        self.refused[cause] += 1
        if (key, cause) not in self._logged and len(self._logged) < MAX_LOGGED:
            self._logged.add((key, cause))
            log.warning("ignored the rendezvous record at %r (%s): %s", key, cause, detail)
