"""A closed round as each member holds it (ftd/coordination/assignment.py, issue 43): its own
assignment, O(1) bytes, where the closing record is N rows. Properties of the assignments,
then real coordinators on a real TCPStore and a real etcd through a restart and a lost node,
forged assignments, and a closer lost between the record and the assignments."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftd.config.serve import ServeConfig
from ftd.coordination.assignment import (
    Assignment,
    assign_key,
    assignments_of,
    round_of,
)
from ftd.coordination.base import Round, new_request
from ftd.coordination.records import Member, MemberRow, RecordCodec, RoundRecord
from ftd.coordination.shared_rounds import key
from tests.conftest import free_port
from tests.coordination.test_job_times import SECRET
from tests.support.etcd_cluster import ClusterFactory


def row(i: int, nproc: int = 8) -> MemberRow:
    return (f"n{i:05d}", f"10.0.{i // 250}.{i % 250}", nproc, 29500, None)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 9999), st.integers(1, 16)), max_size=80, unique_by=lambda t: t[0]
    ),
    st.lists(st.integers(20000, 20010), max_size=3, unique=True),
    st.integers(0, 9),
)
def test_each_members_assignment_is_its_place_in_the_whole_list(
    drawn: list[tuple[int, int]], left_out: list[int], restarts: int
) -> None:
    members = tuple(row(i, nproc) for i, nproc in drawn)
    record = RoundRecord(
        number=3, members=members, restarts=restarts, excluded={"x": "flaky"}, excluded_epoch=2
    )
    joiners = [m[0] for m in members] + [f"n{i:05d}" for i in left_out]
    assigned = assignments_of(record, joiners, revision=17, list_max=0)
    assert set(assigned) == set(joiners)
    for rank, member in enumerate(members):
        mine = Assignment.model_validate_json(assigned[member[0]].model_dump_json())
        assert mine.place is not None and mine.revision == 17
        held = round_of(mine, mine.place, restarts)
        whole = Round.of_members(3, members, restarts, rank, {"x": "flaky"})
        assert held.placement() == whole.placement()
        assert (held.nproc, held.leader, held.successor, held.size) == (
            whole.nproc, whole.leader, whole.successor, whole.size
        )  # fmt: skip
        assert held.members is None and dict(held.excluded) == {"x": "flaky"}
    for node in left_out:
        assert assigned[f"n{node:05d}"].place is None  # it reads the record: late
    short = assignments_of(record, joiners, list_max=len(members))
    assert all(a.place is None for a in short.values())  # a short list is read whole


def test_at_4096_nodes_an_assignment_is_a_few_hundred_bytes_where_the_record_is_the_list() -> None:
    members = tuple(row(i) for i in range(4096))
    record = RoundRecord(number=8, members=members, restarts=3)
    codec = RecordCodec("job", SECRET)
    assigned = assignments_of(record, [m[0] for m in members])
    sizes = [len(codec.encode(key(8, assign_key(n)), a)) for n, a in assigned.items()]
    whole = len(codec.encode(key(8, "closed"), record))
    # 322 bytes against 27 KB packed (142 KB of JSON): what each of 4,096 nodes reads.
    assert max(sizes) < 400 and whole > 20_000, (max(sizes), whole)
    # The successors make one ring: every member is one member's successor.
    successors = [a.place.successor for a in assigned.values() if a.place is not None]
    assert sorted(successors) == sorted(m[0] for m in members)


# -- real coordinators ----------------------------------------------------------------------


def configs(nodes: int) -> list[ServeConfig]:
    return [
        ServeConfig(
            entrypoint=__file__,
            nnodes_min=nodes - 1,
            nnodes_max=nodes,
            rdzv_last_call_timeout_s=0.3,
            run_id="assign",
            node_id=f"n{node:02d}",
            local_addr="127.0.0.1",
            rdzv_list_max=0,  # every node but node rank 0 holds its assignment alone
        )
        for node in range(nodes)
    ]


def member(coordinator: Any) -> Member:
    return Member(node_id=coordinator.node_id, addr="127.0.0.1", nproc=2, store_port=1)


async def started(coordinators: list[Any]) -> list[Any]:
    for coordinator in coordinators:
        await coordinator.start(lambda node, reason: None)
        assert coordinator._rounds.list_max == coordinator.config.rdzv_list_max == 0
    return coordinators


async def restarted(coordinators: list[Any], lose: bool) -> tuple[list[Round], list[Round]]:
    """Every node (started) joins round 0; node rank 0 asks a restart; every node (but the
    last, where `lose`) joins round 1: each node's two rounds."""
    first = await asyncio.wait_for(asyncio.gather(*(c.join(member(c)) for c in coordinators)), 60)
    ended = [c.ended(rnd) for c, rnd in zip(coordinators, first, strict=True)]
    leader = next(c for c, rnd in zip(coordinators, first, strict=True) if rnd.group_rank == 0)
    await leader.request(leader.round, new_request("restart", "a rank failed", leader.node_id))
    await asyncio.wait_for(asyncio.gather(*ended), 30)
    going = coordinators[:-1] if lose else coordinators
    second = await asyncio.wait_for(asyncio.gather(*(c.join(member(c)) for c in going)), 60)
    return first, second


async def assert_held(coordinators: list[Any], rounds: list[Round], number: int) -> None:
    """One round: every node's place its own, the list held by node rank 0 alone, and read by
    any node that asks (an operator's view)."""
    nodes = len(rounds)
    assert {r.number for r in rounds} == {number}
    assert sorted(r.group_rank for r in rounds) == list(range(nodes))
    assert {(r.size, r.leader, r.world_size) for r in rounds} == {
        (nodes, rounds[0].leader, 2 * nodes)
    }
    assert sorted(r.base_global_rank for r in rounds) == list(range(0, 2 * nodes, 2))
    leader = next(r for r in rounds if r.group_rank == 0)
    assert leader.node_ids is not None and len(leader.node_ids) == nodes
    assert all(r.members is None for r in rounds if r.group_rank > 0)
    for coordinator, rnd in zip(coordinators, rounds, strict=False):
        assert await coordinator.roster(rnd) == leader.node_ids


def c10d_coordinators(port: int, nodes: int) -> list[Any]:
    from ftd.coordination.c10d.coordinator import StoreCoordinator

    endpoint = f"127.0.0.1:{port}"
    return [StoreCoordinator(c.model_copy(update={"rdzv_endpoint": endpoint}), secret=SECRET)
            for c in configs(nodes)]  # fmt: skip


async def etcd_coordinators(etcd: ClusterFactory, nodes: int) -> list[Any]:
    from ftd.coordination.etcd.coordinator import EtcdCoordinator

    endpoint = (await etcd(1)).rdzv_endpoint
    update = {"rdzv_backend": "etcd", "rdzv_endpoint": endpoint}
    return [
        EtcdCoordinator(c.model_copy(update=update), SECRET, lambda k, d: None)
        for c in configs(nodes)
    ]


async def on_backend(backend: str, etcd: ClusterFactory, nodes: int) -> tuple[list[Any], Any]:
    """`nodes` coordinators of `backend` (not started), and the TCPStore server they meet at
    (None on etcd)."""
    if backend == "etcd":
        return await etcd_coordinators(etcd, nodes), None
    from ftd_client.store import tcp_store_server

    port = free_port()
    return c10d_coordinators(port, nodes), tcp_store_server("127.0.0.1", port)


@pytest.mark.parametrize("lose", [False, True])
async def test_c10d_members_hold_their_assignments_through_a_restart(lose: bool) -> None:
    from ftd_client.store import tcp_store_server

    port = free_port()
    server = tcp_store_server("127.0.0.1", port)
    coordinators = c10d_coordinators(port, 4)
    try:
        first, second = await restarted(await started(coordinators), lose)
        await assert_held(coordinators, first, 0)
        await assert_held(coordinators, second, 1)
        cluster = await coordinators[1].cluster()  # a node that holds no list
        assert len(cluster["round"]["members"]) == len(second)
    finally:
        for coordinator in coordinators:
            await coordinator.close()
        del server


@pytest.mark.parametrize("lose", [False, True])
async def test_etcd_members_hold_their_assignments_through_a_restart(
    lose: bool, etcd: ClusterFactory
) -> None:
    coordinators = await etcd_coordinators(etcd, 4)
    try:
        first, second = await restarted(await started(coordinators), lose)
        await assert_held(coordinators, first, 0)
        await assert_held(coordinators, second, 1)
        assert all(c.codec.refused["bad_assignment"] == 0 for c in coordinators)
    finally:
        for coordinator in coordinators:
            await coordinator.close()


async def test_c10d_a_forged_assignment_is_refused_and_the_record_read() -> None:
    """Junk at a member's key fails to verify; a signed assignment moved to another node's key
    fails too (the MAC names the key); an unsigned job's assignment that names another node
    is refused by what it says. Each costs that member one whole read, never its round."""
    from ftd_client.store import tcp_store_server

    from ftd.coordination.c10d.assigned import assigned_now

    port = free_port()
    server = tcp_store_server("127.0.0.1", port)
    coordinators = c10d_coordinators(port, 3)
    try:
        rounds = await restarted(await started(coordinators), lose=False)
        one = coordinators[1]
        theirs = next(r for r in rounds[0] if r.group_rank > 0)

        def forge(s: Any) -> list[Any]:
            mine, other = key(0, assign_key("n01")), key(0, assign_key("n02"))
            moved = s.get(other).decode()
            found = []
            for forged in ("junk", moved):
                s.set(mine, forged)
                found.append(assigned_now(s, 0, "n01"))
            unsigned = RecordCodec("assign", None)
            naming = assignments_of(
                RoundRecord(number=0, members=(row(2),), restarts=0), ["n00002"], list_max=0
            )
            s.set(mine, unsigned.encode(mine, naming["n00002"]))
            s.codec = unsigned
            found.append(assigned_now(s, 0, "n01"))
            s.codec = one.codec
            return found

        found = await one._connections.call(forge)
        assert [type(f) for f in found] == [RoundRecord] * 3
        assert theirs.number == 0
    finally:
        for coordinator in coordinators:
            await coordinator.close()
        del server


@pytest.mark.parametrize("backend", ["c10d", "etcd"])
async def test_a_closer_lost_before_the_assignments_costs_the_grace_not_the_round(
    backend: str, monkeypatch: pytest.MonkeyPatch, etcd: ClusterFactory
) -> None:
    """The closer decides the record and writes no assignment (lost between the two): every
    member reads the closing record ASSIGN_GRACE_S after the close, and holds the list."""
    import ftd.coordination.c10d.assigned as c10d_assigned
    import ftd.coordination.c10d.rounds as c10d_rounds
    import ftd.coordination.etcd.coordinator as etcd_coordinator
    import ftd.coordination.etcd.rounds as etcd_rounds

    async def lost_async(*args: Any) -> None:
        return None

    monkeypatch.setattr(c10d_rounds, "write_assignments", lambda *args: None)
    monkeypatch.setattr(etcd_rounds, "write_assignments", lost_async)
    monkeypatch.setattr(c10d_assigned, "ASSIGN_GRACE_S", 0.3)
    monkeypatch.setattr(etcd_coordinator, "assign_grace_s", lambda timeout_s: 0.3)
    coordinators, server = await on_backend(backend, etcd, 3)
    try:
        await started(coordinators)
        rounds = await asyncio.wait_for(
            asyncio.gather(*(c.join(member(c)) for c in coordinators)), 60
        )
        assert sorted(r.group_rank for r in rounds) == [0, 1, 2]
        assert all(r.node_ids is not None and len(r.node_ids) == 3 for r in rounds)
    finally:
        for coordinator in coordinators:
            await coordinator.close()
        del server


@pytest.mark.parametrize("backend", ["c10d", "etcd"])
async def test_a_job_of_nodes_without_the_list_ends_when_every_node_succeeded(
    backend: str, etcd: ClusterFactory
) -> None:
    """The job's end counts marks against the round's size; the node whose counts say every
    member is done reads the list once (`roster`) to check each member's mark."""
    coordinators, server = await on_backend(backend, etcd, 4)
    try:
        await started(coordinators)
        rounds = await asyncio.wait_for(
            asyncio.gather(*(c.join(member(c)) for c in coordinators)), 60
        )
        assert sum(r.members is None for r in rounds) == 3
        ended = [c.ended(r) for c, r in zip(coordinators, rounds, strict=True)]
        for coordinator, rnd in zip(coordinators, rounds, strict=True):
            assert not any(e.done() for e in ended)
            await coordinator.succeeded(rnd)
        requests = await asyncio.wait_for(asyncio.gather(*ended), 30)
        assert {r.action for r in requests} == {"succeed"}
    finally:
        for coordinator in coordinators:
            await coordinator.close()
        del server


async def test_etcd_junk_and_another_rounds_mark_are_not_taken(etcd: ClusterFactory) -> None:
    """Anyone who reaches etcd may write a round's `assigning` key: junk there is refused as
    it comes (the watch waits on for the genuine mark), and a mark that carries another round's
    record (a job without a secret) is not taken: the joiner reads the closing record after
    the grace. The genuine short round's mark gives its record."""
    from ftd.coordination.assignment import ASSIGNING, ClosedMark
    from ftd.coordination.etcd.assigned import _marked

    coordinators = await etcd_coordinators(etcd, 2)
    try:
        await started(coordinators[:1])
        kv = coordinators[0]._kv
        refused = sum(kv.codec.refused.values())
        await kv.etcd.put(key(5, ASSIGNING), b"junk", None)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(_marked(kv, 5, None, 0.01), 1.0)
        assert sum(kv.codec.refused.values()) > refused
        other = RoundRecord(number=7, members=(row(1),), restarts=0)
        await kv.put(key(5, ASSIGNING), ClosedMark(number=5, record=other))
        assert await asyncio.wait_for(_marked(kv, 5, None, 0.01), 10) is None
        mine = RoundRecord(number=6, members=(row(1),), restarts=0)
        await kv.put(key(6, ASSIGNING), ClosedMark(number=6, record=mine))
        found = await asyncio.wait_for(_marked(kv, 6, None, 30), 10)
        assert found is not None and found[0] == mine
    finally:
        for coordinator in coordinators:
            await coordinator.close()
