"""The job's culprit of a hang across nodes (issue 43 item 5): the decision is a pure function of
the nodes' collectives (property tests), and real coordinators on a real TCPStore and a real etcd
share, gather, decide and read it at O(1) operations per node other than node rank 0, whatever
the job's size; a forged record is refused and counted."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftd.coordination import job_culprit
from ftd.coordination.base import new_request
from ftd.coordination.job_culprit import GATHER_MAX_S, GATHER_QUIET_S, decide, gather_wait_s
from ftd.coordination.records import Collectives, JobCulprit, Member
from tests.conftest import free_port
from tests.coordination.test_job_times import c10d_coordinators, etcd_coordinators
from tests.support.etcd_cluster import ClusterFactory

SECRET = b"a job secret of thirty-two bytes!"


def shared(
    node: int, lowest: int | None, since: float = 100.0, judged: bool = False
) -> Collectives:
    return Collectives(
        round=3,
        node_id=f"n{node:02d}",
        group_rank=node,
        lowest=lowest,
        rank=None if lowest is None else 8 * node + 2,
        since=since,
        waiting=7,
        ranks=8,
        judged=judged,
    )


nodes_lowest = st.lists(st.one_of(st.none(), st.integers(0, 5)), min_size=1, max_size=40)


@given(nodes_lowest, st.data())
def test_the_culprit_entered_the_fewest_collectives_of_any_node(
    lowest: list[int | None], data: st.DataObject
) -> None:
    sinces = data.draw(st.lists(st.floats(0, 1e6), min_size=len(lowest), max_size=len(lowest)))
    found = [
        shared(n, low, since) for n, (low, since) in enumerate(zip(lowest, sinces, strict=True))
    ]
    decision = decide(3, reversed(found), 5.0)  # the order read does not matter
    known = [c for c in found if c.lowest is not None]
    if not known:
        assert decision is None
        return
    assert decision is not None
    fewest = min(c.lowest or 0 for c in known)
    tied = [c for c in known if c.lowest == fewest]
    first = min(tied, key=lambda c: (c.since, c.group_rank))  # stopped first, then node rank
    assert (decision.node_id, decision.rank, decision.entered) == (
        first.node_id,
        first.rank,
        fewest,
    )
    assert decision.waiting_nodes == sum((c.lowest or 0) > fewest for c in known)
    assert decision.nodes == len(known) and decision.round == 3
    assert f"node {first.node_id} rank {first.rank}" in decision.reason
    JobCulprit.model_validate(decision.model_dump())  # within the record's bounds


def test_the_reason_says_who_waits_and_who_stopped_first() -> None:
    waited_on = decide(3, [shared(0, 11), shared(1, 10), shared(2, 11)], 1.0)
    assert waited_on is not None
    assert waited_on.reason == (
        "node n01 rank 10 is the job's culprit: it entered 10 collectives, ranks of 2 other "
        "nodes entered more and wait on it"
    )
    tie = decide(3, [shared(0, 4, since=9.0), shared(1, 4, since=8.0)], 1.0)
    assert tie is not None and tie.node_id == "n01" and "it stopped first" in tie.reason
    assert decide(4, [shared(0, 4)], 1.0) is None, "another round's collectives are not read"


@given(
    st.floats(0, 1e6),
    st.floats(0, 10),
    st.floats(0, 10),
)
def test_the_gathering_waits_while_collectives_come_and_never_past_its_bound(
    since: float, news_after: float, now_after: float
) -> None:
    """Node rank 0 waits GATHER_QUIET_S after the last collectives that came, never past
    GATHER_MAX_S after it began: a fake clock, any times."""
    last_news, now = since + news_after, since + news_after + now_after
    left = gather_wait_s(since, last_news, now)
    assert 0 <= left <= GATHER_QUIET_S + 1e-9
    assert left < 1e-9 or now + left <= since + GATHER_MAX_S + 1e-9
    if now_after < GATHER_QUIET_S - 1e-6 and now < since + GATHER_MAX_S - 1e-6:
        assert left > 0, "news came within the quiet time, before the bound: it waits on"
    if now_after >= GATHER_QUIET_S or now >= since + GATHER_MAX_S:
        assert left < 1e-9


async def joined_rounds(coordinators: Sequence[Any], nproc: int = 8) -> list[Any]:
    """Every coordinator started and joined to one round: its round, in the same order."""
    for coordinator in coordinators:
        await coordinator.start(lambda node, reason: None)
    me = [
        Member(node_id=c.node_id, addr="127.0.0.1", nproc=nproc, store_port=1) for c in coordinators
    ]
    return list(await asyncio.gather(*(c.join(m) for c, m in zip(coordinators, me, strict=True))))


async def culprit_of_every_node(coordinators: Sequence[Any], lowest: dict[int, int]) -> list[Any]:
    """Every node joins a round and watches its end, as the daemon does, and the last node's
    hang verdict ends it; then each shares its collectives (node rank r entered lowest[r],
    else 20); node rank 0 gathers and decides, every other node awaits the decision. The
    decisions each node read, by node rank, and the operations each spent taking part."""
    rounds = await joined_rounds(coordinators)
    by_rank = sorted(zip(rounds, coordinators, strict=True), key=lambda pair: pair[0].group_rank)
    ends = [c.ended(rnd) for rnd, c in by_rank]
    last_round, last = by_rank[-1]
    hang = new_request("restart", "a rank hung", by=last.node_id, hang=True)
    await last.request(last_round, hang)
    assert all(request.hang for request in await asyncio.gather(*ends))
    before = [c.ops for _, c in by_rank]

    async def take_part(rnd: Any, coordinator: Any) -> JobCulprit | None:
        r = rnd.group_rank
        mine = Collectives(
            round=rnd.number,
            node_id=coordinator.node_id,
            group_rank=r,
            lowest=lowest.get(r, 20),
            rank=8 * r + 3,
            since=50.0,
            waiting=0,
            ranks=8,
        )
        if r != 0:  # as the daemon's JobCulpritShare: shared in the call that awaits
            return await coordinator.await_culprit(rnd, 30.0, mine)
        await coordinator.share_collectives(rnd, mine)
        found = await coordinator.gather_collectives(rnd)
        decision = decide(rnd.number, found, 60.0)
        assert decision is not None
        return await coordinator.decide_culprit(rnd, decision)

    seen = await asyncio.gather(*(take_part(rnd, c) for rnd, c in by_rank))
    return [*zip(seen, (c.ops - b for (_, c), b in zip(by_rank, before, strict=True)), strict=True)]


@pytest.mark.parametrize("nodes", [4, 16])
async def test_c10d_every_node_reads_the_one_decision_at_a_constant_cost(nodes: int) -> None:
    from ftd_client.store import tcp_store_server

    port = free_port()
    server = tcp_store_server("127.0.0.1", port)
    coordinators = c10d_coordinators(port, nodes)
    try:
        seen = await culprit_of_every_node(coordinators, {nodes - 1: 7, 1: 9})
    finally:
        for coordinator in coordinators:
            await coordinator.close()
        del server
    decisions = {decision for decision, _ in seen}
    assert len(decisions) == 1, "one decision, read alike by every node"
    (decision,) = decisions
    assert decision is not None
    assert (decision.group_rank, decision.rank, decision.entered) == (nodes - 1, 8 * nodes - 5, 7)
    assert decision.waiting_nodes == nodes - 1 and decision.nodes == nodes
    costs = [ops for _, ops in seen]
    # Node rank 0: its put and count, the count read, the wait for every key, their read
    # (check, multi_get), the decision; any other node: its put and count, the wait for the
    # decision and its read (check, get).
    assert costs[0] <= 7 and max(costs[1:]) <= 5, costs  # the same whatever N


async def test_c10d_node_rank_0_decides_without_a_node_that_never_shares() -> None:
    from ftd_client.store import tcp_store_server

    from ftd.coordination.c10d.coordinator import StoreCoordinator

    port = free_port()
    server = tcp_store_server("127.0.0.1", port)
    coordinators: list[StoreCoordinator] = c10d_coordinators(port, 3)  # type: ignore[assignment]
    try:
        rounds = await joined_rounds(coordinators, nproc=1)
        first = next(i for i, rnd in enumerate(rounds) if rnd.group_rank == 0)
        rnd, leader = rounds[first], coordinators[first]
        others = [i for i in range(3) if i != first]
        # One member shares; the other is gone (never shares), and a forged record under a
        # third key claims to be the leader's.
        sharing = coordinators[others[0]]
        theirs = shared(rounds[others[0]].group_rank, 5)
        theirs = theirs.model_copy(update={"round": rnd.number, "node_id": sharing.node_id})
        await sharing.share_collectives(rounds[others[0]], theirs)
        from tests.support.cluster import Attacker

        attacker = Attacker(f"127.0.0.1:{port}", leader.config.run_id)
        attacker.set(f"r{rnd.number}/collectives/{leader.node_id}", "ftd1 - {}")
        # And the count node rank 0 watches the shares by is junk: repaired, never trusted.
        attacker.set(f"r{rnd.number}/collectives_shared", "junk")
        found = await leader.gather_collectives(rnd)  # the rest: none for a while
        assert [c.node_id for c in found] == [sharing.node_id], found
        assert leader.codec.refused, "the forged record is refused and counted"
        assert leader.codec.refused["not_a_counter"] == 1, leader.codec.refused
        decision = decide(rnd.number, found, 1.0)
        assert decision is not None and decision.node_id == sharing.node_id
        assert await coordinators[others[1]].await_culprit(rounds[others[1]], 0.2) is None
        await leader.decide_culprit(rnd, decision)
        assert await coordinators[others[1]].await_culprit(rounds[others[1]], 5) == decision
    finally:
        for coordinator in coordinators:
            await coordinator.close()
        del server


async def test_etcd_every_node_reads_the_one_decision(etcd: ClusterFactory) -> None:
    endpoint = (await etcd(1)).rdzv_endpoint
    nodes = 4
    coordinators = etcd_coordinators(endpoint, nodes, "culprit")
    try:
        seen = await culprit_of_every_node(coordinators, {2: 3})
    finally:
        for coordinator in coordinators:
            await coordinator.close()
    decisions = {decision for decision, _ in seen}
    assert len(decisions) == 1
    (decision,) = decisions
    assert decision is not None and (decision.group_rank, decision.entered) == (2, 3)
    assert decision.waiting_nodes == 3
    assert len(seen) == nodes
    # One transaction that shares this node's collectives and reads the decision; the watch on
    # the round's end, there since the round began, hears it.
    assert max(ops for _, ops in seen[1:]) <= 1, seen


async def test_etcd_a_forged_decision_is_stepped_over_by_the_call_that_shares_and_reads(
    etcd: ClusterFactory,
) -> None:
    """A value planted at the round's culprit key before a node takes part, and keys planted
    beside it under the request's: the node's one call (a transaction that shares its
    collectives and reads the decision) reads the garbage as no decision, refused and counted;
    its end's watch decodes nothing planted beside (not counted); its record reaches node rank
    0, whose decision replaces the garbage; the end's watch hears that decision. A node whose
    end's watch was dropped (its attempt ended otherwise) watches the decision itself."""
    from ftd.coordination.etcd.client import EtcdClient

    cluster = await etcd(1)
    coordinators: list[Any] = etcd_coordinators(cluster.rdzv_endpoint, 3, "culprit-forged")
    try:
        rounds = await joined_rounds(coordinators)
        leader = next(i for i, rnd in enumerate(rounds) if rnd.group_rank == 0)
        other, dropped = (i for i in range(3) if i != leader)
        number = rounds[leader].number
        ends = [c.ended(rnd) for c, rnd in zip(coordinators, rounds, strict=True)]
        ends[dropped].cancel()  # as the supervisor drops it
        hang = new_request("restart", "a rank hung", by=coordinators[other].node_id, hang=True)
        await coordinators[other].request(rounds[other], hang)
        assert (await ends[other]).hang  # its watch is there: it hears what is planted next
        async with EtcdClient(cluster.endpoints, prefix="/ftd/culprit-forged/") as client:
            await client.put(f"r{number}/request/culprit", b"ftd1 - {}")
            for planted in ("request/planted", "requests", "request/culprit/x"):
                await client.put(f"r{number}/{planted}", b"ftd1 - {}")

        def mine(i: int, lowest: int) -> Collectives:
            rnd, node_id = rounds[i], coordinators[i].node_id
            update = {"round": number, "node_id": node_id, "group_rank": rnd.group_rank}
            return shared(rnd.group_rank, lowest).model_copy(update=update)

        before = [c.ops for c in coordinators]
        awaiting = [
            asyncio.ensure_future(coordinators[i].await_culprit(rounds[i], 30.0, mine(i, 4 + i)))
            for i in (other, dropped)
        ]
        await coordinators[leader].share_collectives(rounds[leader], mine(leader, 9))
        found = await coordinators[leader].gather_collectives(rounds[leader])
        assert sorted(c.node_id for c in found) == sorted(c.node_id for c in coordinators)
        decision = decide(number, found, 1.0)
        assert decision is not None and decision.node_id == coordinators[other].node_id
        assert await coordinators[leader].decide_culprit(rounds[leader], decision) == decision
        assert await asyncio.gather(*awaiting) == [decision, decision]
        assert coordinators[other].ops - before[other] == 1, "the transaction alone"
        assert coordinators[dropped].ops - before[dropped] == 2, "a watch of its own too"
        refused = coordinators[other].codec.refused
        # The planted culprit, heard as it was put and read by the transaction; nothing beside.
        assert refused == {"unsigned": 2}, refused
    finally:
        for coordinator in coordinators:
            await coordinator.close()


async def test_etcd_a_read_answered_after_the_window_still_decides(
    etcd: ClusterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loaded etcd answered node rank 0's read of the shared collectives after its gathering
    window (1,024 nodes on one machine): the records read decide, where before none did and no
    node was named. The window bounds the wait for records not there yet, not that read."""
    monkeypatch.setattr(job_culprit, "GATHER_QUIET_S", 0.05)
    cluster = await etcd(1)
    coordinators = etcd_coordinators(cluster.rdzv_endpoint, 3, "culprit-late")
    try:
        rounds = await joined_rounds(coordinators)
        for rnd, coordinator in zip(rounds, coordinators, strict=True):
            lowest = 4 if rnd.group_rank == 2 else 9
            mine = shared(rnd.group_rank, lowest).model_copy(
                update={"round": rnd.number, "node_id": coordinator.node_id}
            )
            await coordinator.share_collectives(rnd, mine)
        leader = next(i for i, rnd in enumerate(rounds) if rnd.group_rank == 0)
        async with cluster.paused(0) as member:
            gathering = asyncio.ensure_future(
                coordinators[leader].gather_collectives(rounds[leader])
            )
            await asyncio.sleep(0.2)  # at least the window: it has passed whatever the load
            # Still stopped: nothing could have answered the read.
            assert member.state in ("T", "t"), (member.state, member.proc)
            assert not gathering.done(), (gathering.result(), member.state, member.log_tail())
        found = await gathering
    finally:
        for coordinator in coordinators:
            await coordinator.close()
    assert len(found) == 3, (found, cluster.members[0].log_tail())
    decision = decide(rounds[leader].number, found, 1.0)
    assert decision is not None and decision.group_rank == 2
