"""The workers' c10d TCPStore, hosted by the daemon: a fresh one for every attempt.

With TORCHELASTIC_USE_AGENT_STORE=True a rank's `init_process_group` uses the store at
MASTER_ADDR:MASTER_PORT as it is, with no per-attempt prefix. torchrun 2.13 shares one store
across attempts, so restarted gloo ranks read the previous attempt's addresses and fail
(pytorch/pytorch#135712). Here each attempt gets a new, empty server that is already listening
before its ranks start, so they neither see stale keys nor pay for hosting a store themselves.

A store is served on the daemon's loop, or, for a job of OWN_PROCESS_FROM_RANKS ranks or more
(`--workers-store-process auto`), in a process of its own (store_process.py): a whole job's
init is a burst that stalls the loop that serves it, and there the daemon's hang verdicts
(0.2 s at 4,096 ranks); a process costs ~19 MiB of PSS, twice (this attempt's store and the
next one), paid only by the jobs whose init is that burst (bench/WORKERS_STORE.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Final, Protocol

from ftd.config.serve import ServeConfig
from ftd.coordination import CoordinationError
from ftd.ranks.store_process import StoreProcess
from ftd.refusals import Refusals
from ftd.tasks import within
from ftd.tcpstore.server import TcpStoreServer

log = logging.getLogger("ftd.store")

STORE_OP_TIMEOUT_S = 30.0
OWN_PROCESS_FROM_RANKS: Final = 1536
"""`--workers-store-process auto`: a job that can have this many ranks gets its store in a
process of its own. Served on the loop, an init stalled it by at most 7 ms at 1,024 ranks,
15 ms at 1,536, 46 ms at 1,792 and 69 ms at 2,048 (bench/WORKERS_STORE.md), where a hang
verdict is due within 20 ms of its deadline (bench/HEALTH.md)."""


def own_process(config: ServeConfig) -> tuple[bool, str]:
    """Whether the workers' store runs in a process of its own, and why."""
    setting, ranks = config.workers_store_process, config.nnodes_max * config.nproc_per_node
    if setting != "auto":
        return setting == "on", f"--workers-store-process {setting}"
    apart = ranks >= OWN_PROCESS_FROM_RANKS
    return apart, f"up to {ranks} ranks, {'>=' if apart else '<'} {OWN_PROCESS_FROM_RANKS}"


class HostedStore(Protocol):
    port: int

    async def close(self) -> None: ...


class AttemptStores:
    """One fresh TCPStore server per attempt, the next one already listening before it is
    needed (its process started, with a fixed port); the previous one is released after the
    switch."""

    def __init__(self, host: str, port: int = 0, own_process: bool = False, why: str = "") -> None:
        self._host = host
        self._port = port
        self._apart = own_process
        self.refusals = Refusals("tcp_store")
        """The store processes' lines refused (their stores count their own)."""
        self._current: HostedStore | None = None
        self._next: asyncio.Task[HostedStore] | None = None
        if self._apart:
            log.info("the workers' store runs in a process of its own (%s)", why or "asked")

    def _prepare_next(self) -> None:
        if self._apart:  # with a fixed --master-port, started now and listening at the switch
            self._next = asyncio.create_task(self._host_store(on_request=self._port != 0))
        elif self._port == 0:  # a fixed --master-port can only be rebound after the switch
            self._next = asyncio.create_task(self._host_store())

    async def _host_store(self, on_request: bool = False) -> HostedStore:
        if self._apart:
            return await StoreProcess.start(self._host, self._port, self.refusals, on_request)
        return await TcpStoreServer.start(self._host, self._port)

    @property
    def pids(self) -> list[int]:
        """The processes of the current store and of the next one, once started."""
        stores, upcoming = [self._current], self._next
        if upcoming and upcoming.done() and not upcoming.cancelled() and not upcoming.exception():
            stores.append(upcoming.result())
        return [store.pid for store in stores if isinstance(store, StoreProcess)]

    async def prepared(self) -> None:
        """Until the next store is ready (or failed: the switch says so), with no effect on it:
        what a measurement waits for before it starts its clock."""
        if self._next is not None:
            await asyncio.wait([self._next])

    async def fresh(self) -> tuple[str, int]:
        """A new, empty, listening store for the next attempt: its (host, port)."""
        if self._next is None:
            await self.close()
            store = await self._host_store()
        else:
            store, self._next = await self._next, None
            if isinstance(store, StoreProcess) and not store.port:
                await self._release_current()  # the fixed port is free for it now
                await store.listen()
        previous, self._current = self._current, store
        if previous is not None:
            await previous.close()
        self._prepare_next()
        log.debug("workers' store for this attempt listens on %s:%d", self._host, store.port)
        return self._host, store.port

    async def fresh_port(self, stop: asyncio.Event, timeout_s: float) -> int | None:
        """`fresh()`'s port. A machine out of ports (or any bind failure) is said in one line
        and retried, with a growing wait, until it works, `stop` is set (None), or `timeout_s`
        passes (CoordinationError)."""
        delay, waited = 0.5, 0.0
        while True:
            try:
                _, port = await self.fresh()
                return port
            except OSError as error:
                why = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
                if waited >= timeout_s:
                    raise CoordinationError(f"cannot host the workers' store: {why}") from None
                log.error("cannot host the workers' store (%s); trying again in %.1fs", why, delay)
            with contextlib.suppress(TimeoutError):
                await within(stop.wait(), delay)
            if stop.is_set():
                return None
            waited += delay
            delay = min(delay * 2, 10.0)

    async def _release_current(self) -> None:
        previous, self._current = self._current, None
        if previous is not None:
            await previous.close()

    async def close(self) -> None:
        stores = [self._current]
        if self._next is not None:
            self._next.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                stores.append(await self._next)
            self._next = None
        self._current = None
        for store in stores:
            if store is not None:
                await store.close()
