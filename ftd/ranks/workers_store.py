"""The workers' c10d TCPStore, hosted by the daemon: a fresh one for every attempt.

With TORCHELASTIC_USE_AGENT_STORE=True a rank's `init_process_group` uses the store at
MASTER_ADDR:MASTER_PORT as it is, with no per-attempt prefix. torchrun 2.13 shares one store
across attempts, so restarted gloo ranks read the previous attempt's addresses and fail
(pytorch/pytorch#135712). Here each attempt gets a new, empty server that is already listening
before its ranks start, so they neither see stale keys nor pay for hosting a store themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ftd.coordination import CoordinationError
from ftd.tasks import within
from ftd.tcpstore.server import TcpStoreServer

log = logging.getLogger("ftd.store")

STORE_OP_TIMEOUT_S = 30.0


class AttemptStores:
    """One fresh TCPStore server per attempt, the next one already listening before it is
    needed; the previous one is released after the switch."""

    def __init__(self, host: str, port: int = 0) -> None:
        self._host = host
        self._port = port
        self._current: TcpStoreServer | None = None
        self._next: asyncio.Task[TcpStoreServer] | None = None

    def _prepare_next(self) -> None:
        if self._port == 0:  # a fixed --master-port can only be rebound after the switch
            self._next = asyncio.create_task(self._host_store())

    async def _host_store(self) -> TcpStoreServer:
        return await TcpStoreServer.start(self._host, self._port)

    async def fresh(self) -> tuple[str, int]:
        """A new, empty, listening store for the next attempt: its (host, port)."""
        if self._next is None:
            await self.close()
            store = await self._host_store()
        else:
            store, self._next = await self._next, None
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
