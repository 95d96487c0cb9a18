"""Node rank 0's gathering of one record per member under a round's prefix, on etcd: one read of
the prefix, then a watch on it from that read's revision until every member's record is there
or the time given is up (never a periodic read). The time given bounds the wait for the records
not there yet; the read of those that are is bounded by etcd's read timeout."""

from __future__ import annotations

import asyncio
import contextlib

from ftd.coordination.etcd.client import EventType, Get
from ftd.coordination.etcd.kv import RecordKv
from ftd.coordination.records import R
from ftd.tasks import within


async def gather_members(
    kv: RecordKv, prefix: str, model: type[R], members: list[str], within_s: float
) -> dict[str, R]:
    """The valid record of each member under `prefix` + node id (a record is its node's only
    at its node's key), those there within `within_s`; etcd away is what was found so far."""
    wanted = set(members)
    found: dict[str, R] = {}

    def take(name: str, record: R | None) -> None:
        node = name.removeprefix(prefix)
        if record is not None and node in wanted and getattr(record, "node_id", None) == node:
            found[node] = record

    async def the_rest(revision: int) -> None:
        async with kv.etcd.watch(prefix, prefix=True, start_revision=revision + 1) as events:
            kv.ops += 1
            async for event in events:
                if event.type is EventType.PUT:
                    take(event.kv.key.decode(errors="replace"), kv.decode(event.kv, model))
                    if wanted <= found.keys():
                        return

    # The window bounds the wait for members not there yet, never the read of those that are:
    # a loaded etcd that answers the read after it would leave nothing to decide with.
    until = asyncio.get_running_loop().time() + within_s
    with contextlib.suppress(Exception):  # etcd away or refusing: decided with what came
        revision, (present,) = await kv.reads(Get(prefix, prefix=True))
        for name, record in kv.valid(present, model).items():
            take(name, record)
        left = until - asyncio.get_running_loop().time()
        if not wanted <= found.keys() and left > 0:
            await within(the_rest(revision), left)
    return found
