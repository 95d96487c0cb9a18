"""Signed records in etcd, decided once with transactions, awaited with watches; and what this
daemon does while etcd does not answer.

- `Availability`: whether etcd answers, as this daemon sees it. The first failed call logs
  one clear line and reports `coordination_unavailable`; the first answer after that logs and
  reports `coordination_restored`. While etcd is away a probe asks it again, backing off, so
  the return is seen even by a daemon with nothing to ask.
- `RecordKv`: every value read goes through the job's RecordCodec (a record that fails is
  logged once and ignored). `decide` makes a record the value of a key unless a valid one is
  there: a transaction compares the key's create_revision (absent) or, when it holds garbage,
  its mod_revision (that very garbage), so a planted value is stepped over, never obeyed.
  `await_decided` watches, then reads: no polling, nothing missed.
- `RecordKv.call`: a call that meets an unavailable etcd is tried again, backing off, until it
  answers or a deadline passes (then CoordinationError(code="store_lost")).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from ftd.coordination.base import CoordinationError, Report
from ftd.coordination.etcd.client import (
    Compare,
    EtcdAuthError,
    EtcdBadAnswer,
    EtcdClient,
    EtcdCompacted,
    EtcdError,
    EtcdUnavailable,
    EventType,
    Get,
    KeyValue,
    Put,
    RangeResult,
    TxnResult,
)
from ftd.coordination.etcd.client.records import TxnOp
from ftd.coordination.memo import BytesMemo
from ftd.coordination.records import MAX_RECORD_BYTES, R, Record, RecordCodec
from ftd.status.event_kind import EventKind

log = logging.getLogger("ftd.coordination.etcd")

T = TypeVar("T")
MAX_REPAIRS = 64
"""Planted values stepped over before a decision gives up (someone is attacking the job)."""
RETRY_PAUSE_S = (0.1, 2.0)
PROBE_PAUSE_S = (0.2, 5.0)


class Availability:
    """Whether etcd answers this daemon; changes are logged once and reported."""

    def __init__(
        self, report: Report, where: str, probe: Callable[[], Awaitable[object]] | None = None
    ) -> None:
        self._report = report
        self._where = where
        self.down_since: float | None = None
        self.probe = probe
        """A call that succeeds once etcd answers again."""
        self._probing: asyncio.Task[None] | None = None

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def failed(self, what: str, error: EtcdError) -> None:
        if self.down_since is not None:
            return
        self.down_since = time.monotonic()
        reason = f"etcd at {self._where} does not answer ({what}): {error}"[:2000]
        log.error(
            "%s. The running attempt goes on; a new round waits for etcd (up to "
            "--rdzv-join-timeout). Lost quorum? A majority of the members must run.",
            reason,
        )
        self._report(EventKind.COORDINATION_UNAVAILABLE, {"reason": reason})
        if self.probe is not None and (self._probing is None or self._probing.done()):
            self._probing = asyncio.create_task(self._probe(self.probe), name="ftd-etcd-probe")

    def answered(self) -> None:
        if self.down_since is None:
            return
        after_s = round(time.monotonic() - self.down_since, 3)
        self.down_since = None
        log.warning("etcd at %s answers again after %.1f s", self._where, after_s)
        self._report(EventKind.COORDINATION_RESTORED, {"after_s": after_s})

    async def _probe(self, probe: Callable[[], Awaitable[object]]) -> None:
        pause = PROBE_PAUSE_S[0]
        while self.down:
            await asyncio.sleep(pause)  # back-off between tries of an absent service
            pause = min(pause * 2, PROBE_PAUSE_S[1])
            try:
                await probe()
            except EtcdError:
                continue
            self.answered()

    async def close(self) -> None:
        if self._probing is not None:
            self._probing.cancel()
            await asyncio.gather(self._probing, return_exceptions=True)


class RecordKv:
    """The job's records in etcd, through one client whose prefix is the job's root."""

    def __init__(self, etcd: EtcdClient, codec: RecordCodec, availability: Availability) -> None:
        self.etcd = etcd
        self.codec = codec
        self.availability = availability
        self.ops = 0
        self.closing = False

    # -- calls, tried again while etcd is away -----------------------------------------------

    async def call(
        self,
        what: str,
        fn: Callable[[], Awaitable[T]],
        deadline: float | None,
        *,
        tried: Callable[[str], object] | None = None,
    ) -> T:
        """`fn()` until etcd answers; CoordinationError once `deadline` (loop time) passed
        with etcd away, or when etcd refuses (credentials, permissions). `tried` (at start)
        hears each failed try; then an endpoint that answers what etcd does not is a mistake,
        not a passing fault (--rdzv-endpoint names something else)."""
        loop = asyncio.get_running_loop()
        pause = RETRY_PAUSE_S[0]
        while True:
            if self.closing:
                raise CoordinationError("the daemon is stopping", "stopped")
            try:
                result = await fn()
            except (EtcdUnavailable, EtcdBadAnswer) as error:
                if isinstance(error, EtcdBadAnswer) and tried is not None:
                    raise CoordinationError(
                        f"--rdzv-endpoint: not etcd's answer ({what}): {error}"[:2000]
                    ) from None
                self.availability.failed(what, error)
                if tried is not None:
                    tried(str(error))
                left = deadline - loop.time() if deadline is not None else pause
                if left <= 0:
                    raise CoordinationError(
                        f"store lost: etcd did not answer within --rdzv-join-timeout; could not "
                        f"{what}: {error}"[:2000],
                        "store_lost",
                    ) from None
                # Back-off, etcd being away; the last try is at the deadline, never before it
                # (said at 1.65 s of a 2 s timeout, when a pause would have passed it).
                await asyncio.sleep(min(pause, left))
                pause = min(pause * 2, RETRY_PAUSE_S[1])
                continue
            except EtcdAuthError as error:
                raise CoordinationError(
                    f"etcd refused ftd's credentials or permissions ({what}): {error}"[:2000]
                ) from None
            except EtcdError as error:
                raise CoordinationError(f"etcd refused to {what}: {error}"[:2000]) from None
            self.availability.answered()
            return result

    # -- records -----------------------------------------------------------------------------

    def decode(self, kv: KeyValue, model: type[R], max_bytes: int = MAX_RECORD_BYTES) -> R | None:
        return self.codec.decode(kv.key.decode(errors="replace"), kv.value, model, max_bytes)

    def encode(self, key: str, record: Record) -> bytes:
        return self.codec.encode(key, record).encode()

    def put_op(self, key: str, record: Record, lease: int | None = None) -> Put:
        return Put(key, self.encode(key, record), lease)

    async def txn(
        self, compare: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp] = ()
    ) -> TxnResult:
        self.ops += 1
        return await self.etcd.txn(compare, success, failure)

    async def reads(self, *gets: Get) -> tuple[int, list[RangeResult]]:
        """Several ranges read at one revision: the revision, the results in order."""
        self.ops += len(gets)
        revision, ranges = await self.etcd.read(gets)
        return revision, list(ranges)

    async def put(self, key: str, record: Record, lease: int | None = None) -> int:
        self.ops += 1
        return await self.etcd.put(key, self.encode(key, record), lease)

    def first(
        self, found: RangeResult, model: type[R], max_bytes: int = MAX_RECORD_BYTES
    ) -> tuple[R | None, KeyValue | None]:
        """The record of a one-key range, and the key as etcd has it (None: absent)."""
        if not found.kvs:
            return None, None
        kv = found.kvs[0]
        return self.decode(kv, model, max_bytes), kv

    def valid(self, found: RangeResult, model: type[R]) -> dict[str, R]:
        """The valid records of a prefix range, by key."""
        records: dict[str, R] = {}
        for kv in found.kvs:
            record = self.decode(kv, model)
            if record is not None:
                records[kv.key.decode(errors="replace")] = record
        return records

    @staticmethod
    def unchanged(key: str, kv: KeyValue | None) -> Compare:
        """The key is as read: absent, or holding what was read (mod_revision)."""
        if kv is None:
            return Compare.create_revision(key, "==", 0)
        return Compare.mod_revision(key, "==", kv.mod_revision)

    async def decide(
        self, key: str, record: R, model: type[R], max_bytes: int = MAX_RECORD_BYTES
    ) -> R:
        """Make `record` the value of `key` unless a valid record is there: the one in force.
        A value that fails to verify is replaced (compared on its mod_revision)."""
        seen: KeyValue | None = None
        for _ in range(MAX_REPAIRS):
            result = await self.txn(
                [self.unchanged(key, seen)], [self.put_op(key, record)], [Get(key)]
            )
            if result.succeeded:
                return record
            found = result.responses[0]
            assert isinstance(found, RangeResult)
            current, seen = self.first(found, model, max_bytes)
            if current is not None:
                return current
        raise CoordinationError(
            f"etcd is under attack: {MAX_REPAIRS} forged values in a row at {key!r}; check who "
            "can write under the job's prefix (docs/architecture.md, the etcd backend)"
        )

    async def read_decided(
        self, key: str, model: type[R], max_bytes: int = MAX_RECORD_BYTES
    ) -> tuple[R | None, int]:
        """The valid record at `key` now (None: none yet): with its mod_revision, else with
        the revision read at."""
        revision, (found,) = await self.reads(Get(key))
        record, kv = self.first(found, model, max_bytes)
        if record is not None and kv is not None:
            return record, kv.mod_revision
        return None, revision

    async def read_decided_with(
        self, changes: Sequence[TxnOp], key: str, model: type[R], max_bytes: int = MAX_RECORD_BYTES
    ) -> tuple[R | None, int]:
        """`changes` made and the record at `key` read in one transaction: read_decided's
        answer, one call instead of two."""
        done = await self.txn([], [*changes, Get(key)])
        found = done.responses[-1]
        if not isinstance(found, RangeResult):
            raise EtcdBadAnswer(f"a transaction's read of {key!r} answered {found!r}")
        record, kv = self.first(found, model, max_bytes)
        if record is not None and kv is not None:
            return record, kv.mod_revision
        return None, done.revision

    async def await_decided(
        self,
        key: str,
        model: type[R],
        max_bytes: int = MAX_RECORD_BYTES,
        *,
        changes: Sequence[TxnOp] = (),
        absent_at: int | None = None,
    ) -> tuple[R, int]:
        """The valid record at `key` once there is one, and its mod_revision. The watch starts
        first, from now, then the key is read: nothing written after the read is missed, and
        etcd serves a watch on the present at once (one that starts in the past waits for its
        catch-up loop, up to 100 ms). With `changes` (puts) the transaction that makes them and
        reads the key comes first, and the watch starts from the revision after it: what the
        others wait on is written one call sooner (1,024 nodes share at once, each call one
        round trip of a loaded store), and the answer, written only after every share, comes
        once the catch-up is long done. `absent_at`: a revision at which the key held no valid
        record (a transaction of this node's compared it, just now): the watch starts after it,
        with no read. Waits out an absent etcd for as long as it takes."""

        def read() -> Awaitable[tuple[R | None, int]]:
            if changes:
                return self.read_decided_with(changes, key, model, max_bytes)
            return self.read_decided(key, model, max_bytes)

        while True:
            if self.closing:
                raise CoordinationError("the daemon is stopping", "stopped")
            try:
                start = None if absent_at is None else absent_at + 1
                if changes:
                    record, revision = await self.call(f"read {key}", read, None)
                    if record is not None:
                        return record, revision
                    start = revision + 1
                async with self.etcd.watch(key, start_revision=start) as events:
                    self.ops += 1
                    if start is None:
                        record, revision = await self.call(f"read {key}", read, None)
                        if record is not None:
                            return record, revision
                    async for event in events:
                        self.availability.answered()
                        if event.type is EventType.PUT:
                            found = self.decode(event.kv, model, max_bytes)
                            if found is not None:
                                return found, event.revision
            except EtcdCompacted:
                absent_at = None  # gone: from now on, and a read
                continue
            except (EtcdUnavailable, EtcdBadAnswer) as error:
                self.availability.failed(f"watch {key}", error)
                await asyncio.sleep(RETRY_PAUSE_S[1])  # back-off: etcd is away


class RecordMemo(Generic[R, T]):
    """A prefix's valid records as `shown(record)`, by key, decoded only where their bytes
    changed since the last read (memo.BytesMemo)."""

    def __init__(self, kv: RecordKv, model: type[R], shown: Callable[[R], T]) -> None:
        self._kv = kv
        self._model = model
        self._shown = shown
        self._memo: BytesMemo[T] = BytesMemo()

    def valid(self, found: RangeResult) -> dict[str, T]:
        return self._memo.take(
            ((kv.key.decode(errors="replace"), kv.value, kv) for kv in found.kvs), self._decoded
        )

    def _decoded(self, kv: KeyValue) -> T | None:
        record = self._kv.decode(kv, self._model)
        return None if record is None else self._shown(record)
