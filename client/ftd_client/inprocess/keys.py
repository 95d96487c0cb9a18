"""The in-process restart contract between `ftd serve --restart-mode inprocess` and the ranks'
`Wrapper`: environment variables, store keys and their JSON values. Standard library only; the
daemon (ftd/ranks/inprocess.py, ftd/ranks/inprocess_store.py) imports this module too, so both
sides read
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

Under a daemon whose job has a secret, the records (arrivals, members, faults, dead slots) are
sealed (`Seal`): an HMAC over (key, value) with a key derived from the job secret and this
attempt's prefix, which the ranks read from a private file (FTD_INPROCESS_KEY_FILE): a value
that fails to unseal was written by someone without the secret, and is stepped over (a fault
never ends a round, a members record is refused, a dead slot or an arrival is ignored). The
counters, the queue, `open` and the wake keys stay plain: a forged one can delay a round (the
hard timeout and hang detection apply), never end or decide one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

ENV_RESTART_MODE = "FTD_RESTART_MODE"
"""`inprocess` when an `ftd serve` daemon coordinates the rounds (`process` otherwise)."""
ENV_STORE_ADDR = "FTD_STORE_ADDR"
"""`host:port` of the coordination TCPStore, hosted by the daemon."""
ENV_PREFIX = "FTD_INPROCESS_PREFIX"
"""The key prefix of this attempt's rounds in that store."""
INPROCESS = "inprocess"
ENV_KEY_FILE = "FTD_INPROCESS_KEY_FILE"
"""A private file (in the run directory) holding this attempt's sealing key, in hex."""

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


SEAL_MAGIC = b"ftds1 "
MAX_KEY_FILE_BYTES = 256


class Forged(ValueError):
    """A value at a key that was not sealed with this attempt's key."""


def derive_key(secret: bytes, prefix: str) -> bytes:
    """The sealing key of one attempt's rounds (a rank holds this, never the job secret)."""
    return hmac.new(secret, b"ftd inprocess\0" + prefix.encode(), hashlib.sha256).digest()


@dataclass(frozen=True)
class Seal:
    """Seals values for their key; without a key (a job without a secret, or no daemon) values
    pass as they are."""

    key: bytes | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Seal:
        path = env.get(ENV_KEY_FILE)
        if not path:
            return cls()
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            text = os.read(fd, MAX_KEY_FILE_BYTES).strip()
        finally:
            os.close(fd)
        return cls(bytes.fromhex(text.decode("ascii")))

    def _mac(self, name: str, payload: bytes) -> bytes:
        assert self.key is not None
        message = name.encode() + b"\0" + payload
        return hmac.new(self.key, message, hashlib.sha256).hexdigest().encode()

    def seal(self, name: str, payload: bytes) -> bytes:
        if self.key is None:
            return payload
        return SEAL_MAGIC + self._mac(name, payload) + b" " + payload

    def unseal(self, name: str, data: bytes | str) -> bytes:
        """The value sealed at `name`; Forged when it is not one (unsealed, another key's)."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        if self.key is None:
            return raw
        if not raw.startswith(SEAL_MAGIC):
            raise Forged(f"{name}: not sealed, and this job has a secret")
        mac, _, payload = raw[len(SEAL_MAGIC) :].partition(b" ")
        if not hmac.compare_digest(mac, self._mac(name, payload)):
            raise Forged(f"{name}: the seal does not match (forged, or replayed from another key)")
        return payload


def claim_fault(store: Any, seal: Seal, key: str, fault: Fault) -> Fault:
    """Write `fault` at `key` unless a valid fault is there (the first writer wins); a forged
    value there is replaced. The key's fault."""
    mine = seal.seal(key, fault.encode())
    stored = bytes(store.compare_set(key, "", mine))
    for _ in range(8):
        try:
            return Fault.decode(seal.unseal(key, stored))
        except Forged:
            stored = bytes(store.compare_set(key, stored, mine))
    return fault


def valid_fault(store: Any, seal: Seal, fault_key: str, wake_key: str) -> Fault | None:
    """The round's fault once the watcher of `wake_key` was woken; None when there is no valid
    one (a forged fault or wake): the wake key is taken back and its watcher waits again. A
    real fault is written before its wake, and read again after the take-back: never missed."""
    for attempt in range(2):
        if store.check([fault_key]):
            try:
                return Fault.decode(seal.unseal(fault_key, store.get(fault_key)))
            except Forged:
                pass
        if attempt == 0:
            store.delete_key(wake_key)
    return None
