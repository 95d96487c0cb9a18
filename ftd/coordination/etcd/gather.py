"""Node rank 0's gathering of one record per member under a round's prefix, on etcd: one read of
the prefix, then a watch on it from that read's revision until every member's record is there
or the time given is up (never a periodic read)."""

from __future__ import annotations

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

    async def until_every_member() -> None:
        revision, (present,) = await kv.reads(Get(prefix, prefix=True))
        for name, record in kv.valid(present, model).items():
            take(name, record)
        if wanted <= found.keys():
            return
        async with kv.etcd.watch(prefix, prefix=True, start_revision=revision + 1) as events:
            kv.ops += 1
            async for event in events:
                if event.type is EventType.PUT:
                    take(event.kv.key.decode(errors="replace"), kv.decode(event.kv, model))
                    if wanted <= found.keys():
                        return

    # Out of time, or etcd away or refusing: the decision is made with what came.
    with contextlib.suppress(Exception):
        await within(until_every_member(), within_s)
    return found
