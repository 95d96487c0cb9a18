"""The watch every node keeps on its round's end (ftd/coordination/etcd/round_end.py), on a real
etcd: after a request that is not a hang's it stops at once; after a hang's it listens for the
culprit's decision HOLD_S at most, and a node that takes part after that watches the decision
itself."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ftd.coordination.base import new_request
from ftd.coordination.etcd import round_end
from ftd.coordination.job_culprit import decide
from ftd.coordination.records import Collectives, Member
from tests.coordination.test_job_culprit import joined_rounds
from tests.coordination.test_job_times import etcd_coordinators
from tests.support.etcd_cluster import ClusterFactory


def collectives(coordinator: Any, rnd: Any, lowest: int) -> Collectives:
    return Collectives(
        round=rnd.number,
        node_id=coordinator.node_id,
        group_rank=rnd.group_rank,
        lowest=lowest,
        rank=8 * rnd.group_rank,
        since=1.0,
        waiting=0,
        ranks=8,
    )


async def test_after_a_failure_the_watch_stops_and_after_a_hang_it_holds_a_while(
    etcd: ClusterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(round_end, "HOLD_S", 0.5)
    cluster = await etcd(1)
    coordinators: list[Any] = etcd_coordinators(cluster.rdzv_endpoint, 2, "round-end")
    try:
        rounds = await joined_rounds(coordinators)
        a, b = coordinators
        end = a.ended(rounds[0])
        await b.request(rounds[1], new_request("restart", "a rank failed", by=b.node_id))
        assert not (await end).hang
        _, heard = a._ends._culprits[rounds[0].number]
        assert await asyncio.wait_for(heard, 10) is None, "stopped at once: nothing to hear"

        me = [Member(node_id=c.node_id, addr="127.0.0.1", nproc=8, store_port=1) for c in (a, b)]
        rounds = list(await asyncio.gather(a.join(me[0]), b.join(me[1])))
        leader = next(i for i, rnd in enumerate(rounds) if rnd.group_rank == 0)
        other = 1 - leader
        end = coordinators[other].ended(rounds[other])
        hang = new_request("restart", "a rank hung", by=coordinators[other].node_id, hang=True)
        await coordinators[leader].request(rounds[leader], hang)
        assert (await end).hang
        _, heard = coordinators[other]._ends._culprits[rounds[other].number]
        assert await asyncio.wait_for(heard, 10) is None, "stopped after its hold"
        mine = collectives(coordinators[other], rounds[other], 3)
        awaiting = asyncio.ensure_future(
            coordinators[other].await_culprit(rounds[other], 30.0, mine)
        )
        theirs = collectives(coordinators[leader], rounds[leader], 7)
        await coordinators[leader].share_collectives(rounds[leader], theirs)
        found = await coordinators[leader].gather_collectives(rounds[leader])
        decision = decide(rounds[leader].number, found, 1.0)
        assert decision is not None and decision.node_id == coordinators[other].node_id
        await coordinators[leader].decide_culprit(rounds[leader], decision)
        assert await awaiting == decision, "watched by the call itself"
    finally:
        for coordinator in coordinators:
            await coordinator.close()


async def test_the_first_end_watch_starts_where_the_round_closed_and_reads_nothing(
    etcd: ClusterFactory,
) -> None:
    """A round's first end watch starts at its closing revision: a request made before it
    was armed is heard all the same (etcd replays it), for one operation, the watch; a later
    watch of the same round starts now and reads (two)."""
    cluster = await etcd(1)
    coordinators: list[Any] = etcd_coordinators(cluster.rdzv_endpoint, 2, "round-end-since")
    try:
        rounds = await joined_rounds(coordinators)
        a, b = coordinators
        await b.request(rounds[1], new_request("restart", "a rank failed", by=b.node_id))
        before = a.ops
        assert (await a.ended(rounds[0])).by == b.node_id
        assert a.ops - before == 1, "the watch alone"
        before = a.ops
        assert (await a.ended(rounds[0])).by == b.node_id
        assert a.ops - before == 2, "a watch from now, and a read"
    finally:
        for coordinator in coordinators:
            await coordinator.close()
