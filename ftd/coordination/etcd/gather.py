"""Node rank 0's gathering of one record per member under a round's prefix, on etcd: one read of
the prefix, then a watch on it from that read's revision until every member's record is there
or none came for a while (job_culprit.gather_wait_s: never a periodic read). The wait bounds
the records not there yet; the read of those that are is bounded by etcd's read timeout."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from ftd.coordination.etcd.client import EventType, Get
from ftd.coordination.etcd.kv import RecordKv
from ftd.coordination.job_culprit import gather_wait_s
from ftd.coordination.records import R


async def gather_members(
    kv: RecordKv, prefix: str, model: type[R], members: Sequence[str]
) -> dict[str, R]:
    """The valid record of each member under `prefix` + node id (a record is its node's only
    at its node's key), those there before the gathering's wait ran out; etcd away is what was
    found so far."""
    wanted = set(members)
    found: dict[str, R] = {}
    clock = asyncio.get_running_loop().time
    since = last_news = clock()

    def take(name: str, record: R | None) -> bool:
        """Keep a member's valid record; whether it is one not had before."""
        node = name.removeprefix(prefix)
        if record is None or node not in wanted or getattr(record, "node_id", None) != node:
            return False
        new = node not in found
        found[node] = record
        return new

    # A loaded etcd may answer the read after the wait's end: what it read still decides.
    with contextlib.suppress(Exception):  # etcd away or refusing: decided with what came
        revision, (present,) = await kv.reads(Get(prefix, prefix=True))
        for name, record in kv.valid(present, model).items():
            take(name, record)
        if wanted <= found.keys():
            return found
        async with asyncio.timeout(clock() + gather_wait_s(since, last_news, clock())) as wait:
            async with kv.etcd.watch(prefix, prefix=True, start_revision=revision + 1) as events:
                kv.ops += 1
                async for event in events:
                    name = event.kv.key.decode(errors="replace")
                    if event.type is EventType.PUT and take(name, kv.decode(event.kv, model)):
                        if wanted <= found.keys():
                            return found
                        last_news = clock()  # still coming: wait on (up to GATHER_MAX_S)
                        wait.reschedule(clock() + gather_wait_s(since, last_news, clock()))
    return found
