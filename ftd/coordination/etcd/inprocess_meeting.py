"""Where a round's ranks meet for in-process restarts under etcd: the TCPStore that node rank 0
hosts and publishes in etcd for the round; the other nodes wait for that record."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ftd.coordination.records import Member

log = logging.getLogger("ftd.rendezvous")


async def leaders_store(
    published: asyncio.Future[tuple[Member, Any]],
    ended: asyncio.Future[Any],
    leader: str,
    number: int,
    timeout_s: float,
) -> tuple[str, int] | None:
    """The in-process store round `number`'s leader published; None when the round ended
    first, the wait timed out, or another node published it. Both futures are cancelled."""
    try:
        both: set[asyncio.Future[Any]] = {published, ended}
        await asyncio.wait(both, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if published.done() and not published.cancelled() and not published.exception():
            record, _ = published.result()
            if record.node_id == leader:
                return record.addr, record.store_port
            log.error("round %d: the in-process store was published by %s", number, record.node_id)
    finally:
        published.cancel()
        ended.cancel()
    return None
