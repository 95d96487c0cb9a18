"""The client's typed records: what callers pass (compares, operations) and get back (key-values,
results, watch events). Keys are bytes or str (UTF-8), relative to the client's prefix; values
are bytes."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

Key = bytes | str
CompareOp = Literal["==", "!=", "<", ">"]
MAX_INT64 = 2**63 - 1


def as_key(key: Key) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with `prefix` (etcd's range_end); b"\\0"
    means "to the end of the key space"."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"
    return stripped[:-1] + bytes([stripped[-1] + 1])


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as etcd stores it. A deleted key in a watch event has only `key` and
    `mod_revision` (the revision of the delete)."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True, slots=True)
class RangeResult:
    """Keys read at `revision` (the store's revision when read: watch from revision + 1 to
    miss nothing after it); `count` is how many matched."""

    kvs: tuple[KeyValue, ...]
    count: int
    revision: int


@dataclass(frozen=True, slots=True)
class PutResult:
    revision: int


@dataclass(frozen=True, slots=True)
class DeleteResult:
    deleted: int
    revision: int


OpResult = RangeResult | PutResult | DeleteResult


@dataclass(frozen=True, slots=True)
class TxnResult:
    """`succeeded`: every compare held and the success branch ran; `responses` hold one result
    per operation of the branch that ran, in order."""

    succeeded: bool
    revision: int
    responses: tuple[OpResult, ...]


class CompareTarget(StrEnum):
    VALUE = "VALUE"
    VERSION = "VERSION"
    CREATE = "CREATE"
    MOD = "MOD"


@dataclass(frozen=True, slots=True)
class Compare:
    """One condition of a transaction. Build it with the class methods: a key never written
    has version 0 and create_revision 0, so `Compare.create_revision(k, "==", 0)` claims k."""

    key: bytes
    target: CompareTarget
    op: CompareOp
    operand: bytes | int

    @classmethod
    def value(cls, key: Key, op: CompareOp, value: bytes) -> Compare:
        return cls(as_key(key), CompareTarget.VALUE, op, bytes(value))

    @classmethod
    def version(cls, key: Key, op: CompareOp, version: int) -> Compare:
        return cls(as_key(key), CompareTarget.VERSION, op, _revision(version))

    @classmethod
    def create_revision(cls, key: Key, op: CompareOp, revision: int) -> Compare:
        return cls(as_key(key), CompareTarget.CREATE, op, _revision(revision))

    @classmethod
    def mod_revision(cls, key: Key, op: CompareOp, revision: int) -> Compare:
        return cls(as_key(key), CompareTarget.MOD, op, _revision(revision))


def _revision(number: int) -> int:
    if isinstance(number, bool) or not 0 <= number <= MAX_INT64:
        raise ValueError(f"a version or revision is an integer in [0, 2**63), not {number!r}")
    return number


@dataclass(frozen=True, slots=True)
class Put:
    key: Key
    value: bytes
    lease: int | None = None


@dataclass(frozen=True, slots=True)
class Get:
    key: Key
    prefix: bool = False
    limit: int = 0
    """At most this many keys of a prefix (the first by key); 0: every one."""


@dataclass(frozen=True, slots=True)
class Delete:
    key: Key
    prefix: bool = False


TxnOp = Put | Get | Delete


class EventType(StrEnum):
    PUT = "PUT"
    DELETE = "DELETE"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: EventType
    kv: KeyValue
    prev_kv: KeyValue | None = None

    @property
    def revision(self) -> int:
        return self.kv.mod_revision
