"""The in-process restart contract between `ftd serve --restart-mode inprocess` and the ranks'
`Wrapper`: environment variables, store keys and their JSON values. Standard library only; the
daemon (ftd/inprocess.py, ftd/inprocess_store.py) imports this module too, so both sides read
one definition.

A *slot* is a rank's initial global RANK: the stable name of a rank across in-process rounds
(its RANK in a round is its index among the round's members). Under a key prefix (one per
process-level attempt) the store holds:

    open                        the round now collecting arrivals (decimal; set by the daemon)
    round/<k>/arrive/<slot>     an Arrival: the rank reached round k's barrier
    barrier                     a queue with an item `<k>:<slot>` after each arrival or
                                write-off: what wakes the daemon deciding the members
    round/<k>/count             arrivals so far (add counter; without a daemon)
    round/<k>/members           Members: who runs round k, and its process group's store
    round/<k>/done              members whose function returned from round k (add counter)
    round/<k>/fault             the first Fault of round k (compare_set: the first writer wins);
                                the last member to return writes a COMPLETED one, so a fault
                                after that loses and a fault before it restarts every member,
                                those that had returned included
    round/<k>/wake/<who>        set to FAULT once round k's fault is written, or to STOP by
                                <who> itself; <who> is a slot or DAEMON. Each watcher blocks
                                on its own wake key: a TCPStore wait is for all keys, never any.
    dead/count, dead/<n>        slots written off by a daemon (their process died and is not
                                respawned): the n-th one; later rounds go on without them
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

ENV_RESTART_MODE = "FTD_RESTART_MODE"
"""`inprocess` when an `ftd serve` daemon coordinates the rounds (`process` otherwise)."""
ENV_STORE_ADDR = "FTD_STORE_ADDR"
"""`host:port` of the coordination TCPStore, hosted by the daemon."""
ENV_PREFIX = "FTD_INPROCESS_PREFIX"
"""The key prefix of this attempt's rounds in that store."""
INPROCESS = "inprocess"

DAEMON = "daemon"
FAULT = b"fault"
STOP = b"stop"
COMPLETED = "completed"
"""The kind of the Fault that ends a round well: every member's function returned."""
DEAD = b"dead"
"""An arrival written by the daemon for a slot whose process died (the job goes on without it)."""


def prefix_for(run_id: str, attempt: int) -> str:
    """The prefix of one process-level attempt's rounds."""
    return f"ftd/inprocess/{run_id}/attempt_{attempt}"


@dataclass(frozen=True)
class Keys:
    prefix: str

    @property
    def open(self) -> str:
        return f"{self.prefix}/open"

    @property
    def barrier(self) -> str:
        return f"{self.prefix}/barrier"

    def arrive(self, rnd: int, slot: int) -> str:
        return f"{self.prefix}/round/{rnd}/arrive/{slot}"

    def count(self, rnd: int) -> str:
        return f"{self.prefix}/round/{rnd}/count"

    def members(self, rnd: int) -> str:
        return f"{self.prefix}/round/{rnd}/members"

    def done(self, rnd: int) -> str:
        return f"{self.prefix}/round/{rnd}/done"

    def fault(self, rnd: int) -> str:
        return f"{self.prefix}/round/{rnd}/fault"

    def wake(self, rnd: int, who: int | str) -> str:
        return f"{self.prefix}/round/{rnd}/wake/{who}"

    @property
    def dead_count(self) -> str:
        return f"{self.prefix}/dead/count"

    def dead(self, n: int) -> str:
        return f"{self.prefix}/dead/{n}"


def _decode(data: bytes | str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError:
        raise ValueError(f"malformed {what} record: {data!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"malformed {what} record: {data!r}")
    return value


@dataclass(frozen=True)
class Fault:
    """Why a round ended: the first fault written for it.

    kind: `exception` (raised by the training function), `soft_timeout` (no progress),
    `rank_exit` (the process died; written by the daemon), `interrupted` (the rank was
    told to restart by someone else; never written as a round's first fault by the Wrapper),
    or `completed` (not a fault: every member returned, and the round ended well).
    """

    kind: str
    rank: int
    """The slot (initial rank) the fault happened on; -1 when unknown."""
    reason: str
    iteration: int
    time: float
    """Wall-clock seconds (time.time()): comparable across the job's processes."""
    by: str
    """Who wrote it: `rank <slot>` or `daemon`."""

    @classmethod
    def now(cls, kind: str, rank: int, reason: str, iteration: int, by: str) -> Fault:
        return cls(kind, rank, reason[:2000], iteration, time.time(), by)

    @property
    def completed(self) -> bool:
        return self.kind == COMPLETED

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes | str) -> Fault:
        value = _decode(data, "fault")
        return cls(
            kind=str(value["kind"]),
            rank=int(value["rank"]),
            reason=str(value["reason"]),
            iteration=int(value["iteration"]),
            time=float(value["time"]),
            by=str(value["by"]),
        )


@dataclass(frozen=True)
class Arrival:
    pid: int
    hard_timeout_s: float
    """The rank's Wrapper hard timeout: the daemon gives a round's ranks this long (the
    longest announced) from a fault to reach the next barrier."""

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes | str) -> Arrival:
        value = _decode(data, "arrival")
        return cls(pid=int(value["pid"]), hard_timeout_s=float(value["hard_timeout_s"]))


@dataclass(frozen=True)
class Members:
    """Who runs a round, in rank order, and the fresh store its process group meets in."""

    slots: tuple[int, ...]
    master_addr: str
    master_port: int
    decided_by: str

    def rank_of(self, slot: int) -> int | None:
        return self.slots.index(slot) if slot in self.slots else None

    def encode(self) -> bytes:
        return json.dumps({**asdict(self), "slots": list(self.slots)}).encode()

    @classmethod
    def decode(cls, data: bytes | str) -> Members:
        value = _decode(data, "members")
        return cls(
            slots=tuple(int(s) for s in value["slots"]),
            master_addr=str(value["master_addr"]),
            master_port=int(value["master_port"]),
            decided_by=str(value["decided_by"]),
        )
