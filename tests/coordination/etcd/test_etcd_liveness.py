"""etcd liveness at scale (issue 43). Each node watches only the alive keys it reports: node
rank 0 the prefix, every other node node rank 0's key alone, nobody before its first round
(watching the whole prefix from the start sent every node's alive key to every node: N²
events, and at 1,024 nodes round 0 did not form). A node whose lease etcd ended while its
keepalives went unanswered joins under the lease that replaces it (at 1,024 nodes node rank 0
was refused its next join: "requested lease not found"). Real etcd; the watches asked for are
recorded on their way out."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ftd.config.serve import ServeConfig
from ftd.coordination.etcd.client import EtcdClient
from ftd.coordination.etcd.coordinator import EtcdCoordinator
from ftd.coordination.records import Member
from tests.support.etcd_cluster import ClusterFactory

pytestmark = pytest.mark.timeout(120)

SECRET = b"a job secret of thirty-two bytes!"
NODES = 5


def node(endpoint: str, node_id: str, nodes: int = NODES, keepalive_s: int = 1) -> EtcdCoordinator:
    config = ServeConfig(
        entrypoint=__file__,
        nnodes_min=nodes,
        nnodes_max=nodes,
        rdzv_backend="etcd",
        rdzv_endpoint=endpoint,
        run_id="scope",
        node_id=node_id,
        local_addr="127.0.0.1",
        node_keepalive_timeout_s=keepalive_s,
        rdzv_last_call_timeout_s=0,
    )
    return EtcdCoordinator(config, SECRET, lambda kind, data: None)


async def test_node_rank_0_watches_every_alive_key_the_others_only_its_own(
    etcd: ClusterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    members = await etcd(1)
    asked: list[tuple[str, bool]] = []
    every_node_watches = asyncio.Event()
    watch = EtcdClient.watch

    def recorded(self: EtcdClient, key: bytes | str, **options: Any) -> Any:
        text = key.decode() if isinstance(key, bytes) else key
        if text.startswith("alive/"):
            asked.append((text, bool(options.get("prefix"))))
            if len(asked) >= NODES:
                every_node_watches.set()
        return watch(self, key, **options)

    monkeypatch.setattr(EtcdClient, "watch", recorded)
    ids = [f"n{i}" for i in range(NODES)]
    nodes = [node(members.rdzv_endpoint, i) for i in ids]
    lost: dict[str, asyncio.Queue[str]] = {i: asyncio.Queue() for i in ids}
    try:
        for n in nodes:
            await n.start(lambda gone, reason, me=n.node_id: lost[me].put_nowait(gone))
        assert asked == []  # nobody watches before a round: nothing to report yet
        me = [Member(node_id=i, addr="127.0.0.1", nproc=1, store_port=1) for i in ids]
        rounds = await asyncio.gather(*(n.join(m) for n, m in zip(nodes, me, strict=True)))
        first = rounds[0].node_ids[0]
        await asyncio.wait_for(every_node_watches.wait(), 30)  # by tasks the joins started
        assert sorted(asked) == sorted(
            [("alive/", True)] + [(f"alive/{first}", False)] * (NODES - 1)
        ), asked
        # The watches report what they follow: a follower's lease ends, node rank 0 hears;
        # then node rank 0's, and every follower hears.
        by_id = dict(zip(ids, nodes, strict=True))
        follower = next(i for i in ids if i != first)
        async with EtcdClient(members.endpoints) as admin:
            liveness = by_id[follower]._liveness
            assert liveness is not None
            await admin.revoke(liveness.lease_id)
            assert await asyncio.wait_for(lost[first].get(), 10) == follower
            liveness = by_id[first]._liveness
            assert liveness is not None
            await admin.revoke(liveness.lease_id)
            for i in ids:
                if i not in (first, follower):
                    assert await asyncio.wait_for(lost[i].get(), 10) == first
    finally:
        for n in nodes:
            await n.close()


async def test_a_join_under_a_lease_etcd_ended_is_made_under_the_lease_that_replaces_it(
    etcd: ClusterFactory,
) -> None:
    members = await etcd(1)
    # A keepalive of 30 s: the lease's own renewal (every 10 s) does not see it gone first.
    a = node(members.rdzv_endpoint, "a", nodes=1, keepalive_s=30)
    try:
        await a.start(lambda gone, reason: None)
        liveness = a._liveness
        assert liveness is not None
        ended = liveness.lease_id
        async with EtcdClient(members.endpoints) as admin:
            await admin.revoke(ended)  # what etcd does to a lease it heard nothing from
            rnd = await a.join(Member(node_id="a", addr="127.0.0.1", nproc=1, store_port=1))
            joined = await admin.get(f"/ftd/scope/r{rnd.number}/join/a")
            alive = await admin.get("/ftd/scope/alive/a")
        assert rnd.node_ids == ("a",) and not a.lost.is_set()
        assert joined is not None and alive is not None
        assert joined.lease == alive.lease == liveness.lease_id != ended
    finally:
        await a.close()
