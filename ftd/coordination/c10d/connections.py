"""The c10d coordinator's connections to the rendezvous store, and how its calls are bounded.

- the operations connection: short calls, each bounded (`call`);
- the keepalive connection (`beats`): liveness.Keepalive's alone;
- one connection per blocking wait (`wait`), taken while idle or opened for it: a wait lasts
  as long as what it waits for, with no c10d timeout (so no c10d warnings), and never holds up
  a short call. A wait for a decided record (`wait_decided`) is backed by a look at its key
  BACKUP_CHECK_S after it began, then at twice the interval each time, on the operations
  connection; a record found there is read here only if the wait has not returned it one
  interval later (on a busy machine the woken wait is reading it: read twice, a round's
  closing record cost 1,024 virtual nodes twice the CPU, bench/SCALE.md).

A call that fails with a store error or outlives its bound is reported to the coordinator
(`store_lost`), which marks the store lost and gives the CoordinationError raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ftd.coordination.base import CoordinationError
from ftd.coordination.c10d.record_store import MAX_CHAIN, ChainExhausted, Connection, RecordStore
from ftd.coordination.records import RecordCodec
from ftd.tasks import within
from ftd.tcpstore.client import StoreGone

log = logging.getLogger("ftd.rendezvous")

STORE_TIMEOUT_S = 30.0
BACKUP_CHECK_S = 5.0
"""A wait that blocks in the store is backed by a look at the key this long after it began, on
the operations connection: a wake-up that never comes would cost seconds, not the job. Each
look after is twice as late, up to BACKUP_CHECK_MAX_S: a round's end is waited for as long as
the job runs, and its looks cost a node ~0.03 store operations per second, not 0.2."""
BACKUP_CHECK_MAX_S = 30.0
T = TypeVar("T")


class StoreConnections:
    """One daemon's connections to the rendezvous store under `prefix`."""

    def __init__(
        self,
        endpoint: tuple[str, int],
        prefix: str,
        codec: RecordCodec,
        store_lost: Callable[[str], CoordinationError],
    ) -> None:
        self.endpoint = endpoint
        self.prefix = prefix
        self.codec = codec
        self._store_lost = store_lost
        """Marks the store lost, for the reason given; returns the error to raise."""
        self.operations = Connection("ftd-rdzv")
        self.beats = Connection("ftd-keepalive")
        self._waiters: list[Connection] = []

    @property
    def ops(self) -> int:
        """Store operations sent by this daemon (all connections)."""
        conns = [self.operations, self.beats, *self._waiters]
        return sum(c.store.ops for c in conns if c.store is not None)

    def _factory(self) -> RecordStore:
        host, port = self.endpoint
        return RecordStore(host, port, self.prefix, self.codec, STORE_TIMEOUT_S)

    async def open(self) -> None:
        """Connect the operations and keepalive connections and a first waiter."""
        try:
            await self.operations.open(self._factory)
            await self.beats.open(self._factory)
            self._waiters.append(await self._new_waiter())
        except Exception as error:
            host, port = self.endpoint
            first_line = (str(error).splitlines() or [type(error).__name__])[0][:200]
            raise CoordinationError(  # c10d's text goes on with a C++ stack: its first line
                f"cannot reach the rendezvous store at {host}:{port}: {first_line}", "store_lost"
            ) from None

    async def _new_waiter(self) -> Connection:
        conn = Connection(f"ftd-rdzv-wait-{len(self._waiters)}")
        await conn.open(self._factory)
        return conn

    def close(self) -> None:
        for conn in [self.operations, self.beats, *self._waiters]:
            conn.close()

    async def call(
        self, fn: Callable[..., T], *args: Any, timeout_s: float = 2 * STORE_TIMEOUT_S
    ) -> T:
        """A short blocking store call on the operations connection, bounded."""
        return await self._guard(self.operations.call(fn, *args), timeout_s)

    async def wait(self, fn: Callable[..., T], *args: Any) -> T:
        """A wait that lasts as long as what it waits for, on an idle connection of its own."""
        idle = next((c for c in self._waiters if not c.thread.busy), None)
        conn = idle if idle is not None else await self._guard(self._new_waiter(), STORE_TIMEOUT_S)
        if idle is None:
            self._waiters.append(conn)
        conn.thread.busy = True  # taken now, before its thread picks the call up
        return await self._guard(conn.call(fn, *args), None)

    async def wait_decided(
        self,
        wait: Callable[[RecordStore, int], T],
        now: Callable[[RecordStore, int], T | None],
        number: int,
        slot: str,
        what: str,
    ) -> T:
        """`wait` for round `number`'s decided record at `slot`, backed by a look every
        BACKUP_CHECK_S: where the record is there, the wait is given one more interval to
        return (on a busy machine it is reading it) before `now` reads it again here."""
        waiting = asyncio.ensure_future(self.wait(wait, number))
        # Its error (a lost store) may come while this is cancelled: retrieved here, always.
        waiting.add_done_callback(lambda done: done.cancelled() or done.exception())
        since, pause = time.monotonic(), BACKUP_CHECK_S
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=pause)
                if waiting in done:
                    return waiting.result()
                if not await self.call(lambda s: s.check([slot])):
                    pause = min(pause * 2, BACKUP_CHECK_MAX_S)
                    continue
                seen = time.monotonic()
                done, _ = await asyncio.wait({waiting}, timeout=BACKUP_CHECK_S)
                if waiting in done:
                    return waiting.result()
                found = await self.call(now, number)
                if found is not None:
                    log.warning(
                        "round %d: %s was in the store %.1fs ago but this node's store wait "
                        "had not returned it (waiting %.1fs); going on without it",
                        number,
                        what,
                        time.monotonic() - seen,
                        time.monotonic() - since,
                    )
                    return found
        finally:
            waiting.cancel()
            with contextlib.suppress(BaseException):
                await waiting

    async def _guard(self, call: Awaitable[T], timeout_s: float | None) -> T:
        try:
            return await within(call, timeout_s)
        except (StoreGone, TimeoutError) as error:
            said = (str(error).splitlines() or [""])[0][:200]  # asyncio's timeout says nothing
            raise self._store_lost(f"{type(error).__name__}: {said}") from None
        except ChainExhausted as error:
            raise CoordinationError(
                f"the rendezvous store is under attack: {MAX_CHAIN} forged records in a row at "
                f"{error}; check who can reach it (docs/security.md)"
            ) from None
