"""Blocking c10d TCPStore calls, made safe for an event loop and for hostile values.

- `StoreThread`: one connection and one daemon thread that makes its calls in order; each call
  comes back to the loop as an awaitable. A daemon thread, not an executor's: a call stuck in a
  store that stopped answering must not hold the process at exit (concurrent.futures joins its
  workers at interpreter exit).
- `Connection`: a StoreThread with its own RecordStore.
- `RecordStore`: a connection under the job's prefix that counts and times every operation,
  writes and reads signed records (records.py), and decides a value once for every node with a
  *chain* of keys: the first valid record in `k`, `k#1`, `k#2`, ... wins, so a value planted
  by someone without the secret cannot wedge a round, only be stepped over.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ftd.coordination.records import MAX_RECORD_BYTES, R, Record, RecordCodec
from ftd.status.instruments import STORE_OPERATION_SECONDS
from ftd.tcpstore.client import StoreClient, StoreGone, StoreTimeout

log = logging.getLogger("ftd.coordination.store")

MAX_CHAIN = 64
"""Forged values stepped over before a decision gives up (the store is under attack)."""
T = TypeVar("T")
NO_TIMEOUT_S = 10 * 365 * 86400.0
"""A wait "as long as it takes" (closing the connection ends it)."""
_Call = tuple[Callable[[], Any], Callable[[Any, bool], None]]


class ChainExhausted(Exception):
    """Every slot of a decided key held a record that fails to verify."""


class StoreThread:
    """Calls on one connection, one at a time, in a daemon thread of their own."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        self.busy = False

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            call, done = item
            self.busy = True
            try:
                result, failed = call(), False
            except BaseException as error:
                result, failed = error, True
            self.busy = False
            done(result, failed)

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def done(result: Any, failed: bool) -> None:
            def settle() -> None:
                if future.done():
                    return
                if failed:
                    future.set_exception(result)
                else:
                    future.set_result(result)

            if not loop.is_closed():
                loop.call_soon_threadsafe(settle)

        self._calls.put((lambda: fn(*args), done))
        return future

    def stop(self, last: Callable[[], object] | None = None) -> None:
        """Leave after the calls queued so far and `last` (a call stuck in a dead store is left
        behind)."""
        if last is not None:
            self._calls.put((last, lambda result, failed: None))
        self._calls.put(None)


PEEK = "\x00ftd peek"
"""The expectation of `peek`'s compare_set: never a record's value."""


class RecordStore:
    """One connection to the rendezvous store under `ftd/<rdzv id>/`, records in and out."""

    def __init__(
        self, host: str, port: int, prefix: str, codec: RecordCodec, timeout_s: float
    ) -> None:
        self._address = (host, port, prefix, timeout_s)
        self.codec = codec
        self.ops = 0
        self._connect()

    def _connect(self) -> None:
        """(Re)connect with ftd's client (no torch in the daemon); keys under `prefix/`, as
        torch's PrefixStore puts them (ranks and tools that read them with torch agree)."""
        host, port, prefix, timeout_s = self._address
        old = getattr(self, "raw", None)
        self.raw = StoreClient(host, port, timeout_s)
        if old is not None:
            old.close()
        self._prefix = f"{prefix}/"

    def _key(self, key: str) -> str:
        return self._prefix + key

    def close(self) -> None:
        self.raw.close()

    def _timed(self, operation: str, fn: Callable[..., T], *args: Any) -> T:
        self.ops += 1
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            STORE_OPERATION_SECONDS.labels(operation).observe(time.perf_counter() - start)

    # -- raw operations ----------------------------------------------------------------------

    def add(self, key: str, amount: int) -> int:
        return self._timed("add", self.raw.add, self._key(key), amount)

    def set(self, key: str, value: str) -> None:
        self._timed("set", self.raw.set, self._key(key), value)

    def get(self, key: str) -> bytes:
        return self._timed("get", self.raw.get, self._key(key))

    def check(self, keys: list[str]) -> bool:
        return self._timed("check", self.raw.check, [self._key(k) for k in keys])

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._timed("compare_set", self.raw.compare_set, self._key(key), expected, desired)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._timed("multi_get", self.raw.multi_get, [self._key(k) for k in keys])

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        self._timed("multi_set", self.raw.multi_set, [self._key(k) for k in keys], values)

    def delete_key(self, key: str) -> bool:
        return self._timed("delete_key", self.raw.delete_key, self._key(key))

    def wait(self, keys: list[str], timeout_s: float | None = None) -> bool:
        """Whether the keys exist within the timeout (None: as long as it takes)."""
        limit = NO_TIMEOUT_S if timeout_s is None else timeout_s
        return self._timed("wait", self.raw.waited, [self._key(k) for k in keys], limit)

    def set_timeout(self, timeout_s: float) -> None:
        self.raw.set_timeout(timeout_s)

    def count(self, key: str, amount: int, repair: Callable[[], int]) -> int:
        """`add` on a counter that someone may have overwritten. The store drops the connection
        of a client that adds to a value that is no number; so when an add fails, reconnect
        (StoreGone again: the store is really gone), and if the value is no number,
        put back `repair()` (what the counter must at least be) and add again."""
        for _ in range(3):
            try:
                return self.add(key, amount)
            except StoreGone:
                self._connect()
            raw = self.get(key) if self.check([key]) else b"0"
            if raw.strip().lstrip(b"-").isdigit():
                continue  # a passing network fault: the counter is fine
            self.codec.refused["not_a_counter"] += 1
            log.warning("the counter at %r held %r (forged): repaired", key, raw[:40])
            self.compare_set(key, raw.decode(errors="replace"), str(repair()))
        return self.add(key, amount)

    # -- records -----------------------------------------------------------------------------

    def put(self, key: str, record: Record) -> None:
        self.set(key, self.codec.encode(key, record))

    def get_if_present(self, key: str) -> bytes | None:
        """The value at `key`, or None when it is not there (or was deleted meanwhile)."""
        if not self.check([key]):
            return None
        try:
            return self.get(key)
        except StoreTimeout:  # deleted between the check and the get: waited, timed out
            return None

    def read(self, key: str, model: type[R], max_bytes: int = MAX_RECORD_BYTES) -> R | None:
        """The record at `key` if it is there and valid (no wait for a missing key)."""
        raw = self.get_if_present(key)
        return None if raw is None else self.codec.decode(key, raw, model, max_bytes)

    def peek(self, key: str, model: type[R], max_bytes: int = MAX_RECORD_BYTES) -> R | None:
        """`read` in one operation: a compare_set whose expectation no value holds (a record
        begins `ftd1 `) answers the value, or that expectation where there is none, and sets
        nothing either way (c10d's rule, torch's server and ftd's alike). Both servers wake
        the key's waiters on it, set or not: never for a key someone waits on (a decided
        one), where the waiters' reads would wake one another."""
        raw = self.compare_set(key, PEEK, PEEK)
        if raw == PEEK.encode():
            return None
        return self.codec.decode(key, raw, model, max_bytes)

    def read_many(self, keys: list[str], model: type[R]) -> dict[str, R]:
        """The valid records among `keys`; missing ones are skipped, never waited for."""
        if len(keys) == 1:  # one operation, not a check and a get (every node's every beat)
            one = self.peek(keys[0], model)
            return {keys[0]: one} if one is not None else {}
        found: dict[str, R] = {}
        for key, raw in self.values_of(keys).items():
            record = self.codec.decode(key, raw, model)
            if record is not None:
                found[key] = record
        return found

    def values_of(self, keys: list[str]) -> dict[str, bytes]:
        """The values (undecoded) of those of `keys` that are there, never waited for."""
        if not keys:
            return {}
        present = keys if self.check(keys) else [k for k in keys if self.check([k])]
        try:
            values = self.multi_get(present) if present else []
        except StoreTimeout:  # one was deleted meanwhile: read them one by one
            pairs = [(key, self.get_if_present(key)) for key in present]
            present = [key for key, raw in pairs if raw is not None]
            values = [raw for _, raw in pairs if raw is not None]
        return dict(zip(present, values, strict=True))

    # -- decided values: the first valid record of a chain -----------------------------------

    @staticmethod
    def slot(key: str, index: int) -> str:
        return key if index == 0 else f"{key}#{index}"

    def decide(
        self, key: str, record: Record, model: type[R], max_bytes: int = MAX_RECORD_BYTES
    ) -> R:
        """Make `record` the decided value of `key` unless a valid one is there: the one in
        force."""
        for index in range(MAX_CHAIN):
            slot = self.slot(key, index)
            mine = self.codec.encode(slot, record)
            current = self.compare_set(slot, "", mine)
            decided = self.codec.decode(slot, current, model, max_bytes)
            if decided is not None:
                return decided
        raise ChainExhausted(key)

    def decided(self, key: str, model: type[R], max_bytes: int = MAX_RECORD_BYTES) -> R | None:
        """The decided value of `key` if there is one now (no wait)."""
        for index in range(MAX_CHAIN):
            slot = self.slot(key, index)
            raw = self.get_if_present(slot)
            if raw is None:
                return None
            record = self.codec.decode(slot, raw, model, max_bytes)
            if record is not None:
                return record
        raise ChainExhausted(key)

    def await_decided(self, key: str, model: type[R], max_bytes: int = MAX_RECORD_BYTES) -> R:
        """Blocking, as long as it takes: the decided value of `key` once there is one."""
        index = 0
        while index < MAX_CHAIN:
            slot = self.slot(key, index)
            self.wait([slot])
            raw = self.get_if_present(slot)
            if raw is None:
                continue  # deleted between the wait and the get: wait again
            record = self.codec.decode(slot, raw, model, max_bytes)
            if record is not None:
                return record
            index += 1
        raise ChainExhausted(key)


class Connection:
    """A StoreThread with its own RecordStore."""

    def __init__(self, name: str) -> None:
        self.thread = StoreThread(name)
        self.store: RecordStore | None = None

    async def open(self, factory: Callable[[], RecordStore]) -> None:
        self.store = await self.thread.submit(factory)

    def call(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        assert self.store is not None
        return self.thread.submit(fn, self.store, *args)

    def close(self) -> None:
        self.thread.stop(self.store.close if self.store is not None else None)
