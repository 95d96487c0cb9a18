"""Round N's closing record as round N-1's members read it (ftd/coordination/round_delta.py,
issue 43): a delta against their own copy of the list, O(changes) bytes for each where the whole
record was N rows. Properties of the delta, then real coordinators on a real TCPStore and a real
etcd through a restart, a lost node and forged deltas."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftd.config.serve import ServeConfig
from ftd.coordination.base import Round, new_request
from ftd.coordination.records import Member, MemberRow, RoundRecord
from ftd.coordination.round_delta import (
    ADDED,
    DELTA,
    RoundDelta,
    delta_of,
    members_digest,
    resolve,
)
from ftd.coordination.shared_rounds import key
from tests.conftest import free_port
from tests.coordination.test_job_times import SECRET
from tests.support.etcd_cluster import ClusterFactory


def row(i: int, port: int = 29500) -> MemberRow:
    return (f"n{i:05d}", f"10.0.{i // 250}.{i % 250}", 8, port, None)


def closed(number: int, members: list[MemberRow], restarts: int = 0) -> RoundRecord:
    return RoundRecord(number=number, members=tuple(members), restarts=restarts)


# -- the delta ------------------------------------------------------------------------------


@st.composite
def two_rounds(draw: st.DrawFn) -> tuple[RoundRecord, RoundRecord]:
    """A round and the next: members kept in any order, some with a new port, some gone,
    some new."""
    base = [row(i) for i in range(draw(st.integers(0, 40)))]
    kept = draw(st.permutations(base))[: draw(st.integers(0, len(base)))]
    moved = draw(st.sets(st.integers(0, max(len(kept) - 1, 0)), max_size=4))
    kept = [row(int(r[0][1:]), 29501) if i in moved else r for i, r in enumerate(kept)]
    new = [row(1000 + i) for i in range(draw(st.integers(0, 40)))]
    at = draw(st.integers(0, len(kept)))
    excluded = draw(st.dictionaries(st.sampled_from(["x1", "x2"]), st.just("flaky")))
    after = RoundRecord(
        number=5,
        members=tuple(kept[:at] + new + kept[at:]),
        restarts=draw(st.integers(0, 9)),
        excluded=excluded,
        excluded_epoch=len(excluded),
    )
    return closed(4, base), after


@settings(max_examples=300, deadline=None)
@given(two_rounds())
def test_a_delta_rebuilds_the_next_round_from_the_round_before(
    rounds: tuple[RoundRecord, RoundRecord],
) -> None:
    before, after = rounds
    delta = delta_of(after, before)
    rebuilt = resolve(RoundDelta.model_validate_json(delta.model_dump_json()), 4, before.members)
    if delta.whole:  # most rows new: read whole
        assert rebuilt is None and 2 * sum(r not in before.members for r in after.members) > len(
            after.members
        )
    else:
        assert rebuilt is not None and rebuilt.model_dump() == after.model_dump()
    assert resolve(delta, 3, before.members) is None  # another base: read whole


def test_a_restart_of_4096_nodes_that_lost_one_costs_a_member_bytes_not_the_list() -> None:
    before = closed(7, [row(i) for i in range(4096)])
    after = closed(8, [r for r in before.members if r[0] != "n02000"] + [row(5000)], 3)
    delta = delta_of(after, before)
    assert delta.runs == ((0, 2000), (2001, 2095), (ADDED, 1)) and delta.added == (row(5000),)
    small, whole = len(delta.model_dump_json()), len(after.model_dump_json())
    assert small < 400 and whole > 150_000  # ~300 bytes where the whole record is 151 KB
    assert resolve(delta, 7, before.members) == after
    aborted = RoundRecord(number=8, members=(), restarts=3, aborted="too few nodes")
    assert resolve(delta_of(aborted, before), 7, ()) == aborted  # told at once, any base


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-3, 60), st.integers(1, 60)), max_size=8),
    st.lists(st.integers(0, 99), max_size=8),
    st.booleans(),
)
def test_a_forged_delta_is_read_whole_never_an_error(
    runs: list[tuple[int, int]], added: list[int], right_digest: bool
) -> None:
    base = tuple(row(i) for i in range(30))
    delta = RoundDelta.model_construct(
        number=5,
        base=4,
        runs=tuple(runs),
        added=tuple(row(100 + i) for i in added),
        digest=members_digest(base) if right_digest else "0" * 32,
        restarts=0,
        excluded={},
        excluded_epoch=0,
        aborted=None,
        whole=False,
    )
    rebuilt = resolve(delta, 4, base)
    assert rebuilt is None or members_digest(rebuilt.members) == delta.digest


# -- real coordinators ----------------------------------------------------------------------


@pytest.fixture
def rebuilt(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Each delta a node read: whether it rebuilt the round from it."""
    import ftd.coordination.round_delta as round_delta

    seen: list[bool] = []

    def spy(delta: RoundDelta, number: int, base: tuple[MemberRow, ...]) -> RoundRecord | None:
        found = resolve(delta, number, base)
        seen.append(found is not None)
        return found

    monkeypatch.setattr(round_delta, "resolve", spy)  # as rebuilt() calls it
    yield seen


def configs(nodes: int, **more: Any) -> list[ServeConfig]:
    return [
        ServeConfig(
            entrypoint=__file__,
            nnodes_min=nodes - 1,
            nnodes_max=nodes,
            rdzv_last_call_timeout_s=0.3,
            run_id="delta",
            node_id=f"n{node:02d}",
            local_addr="127.0.0.1",
            **more,
        )
        for node in range(nodes)
    ]


def member(coordinator: Any) -> Member:
    return Member(node_id=coordinator.node_id, addr="127.0.0.1", nproc=2, store_port=1)


async def started(coordinators: list[Any]) -> list[Any]:
    for coordinator in coordinators:
        await coordinator.start(lambda node, reason: None)
    return coordinators


async def restarted(coordinators: list[Any], lose: bool) -> tuple[list[Round], list[Round]]:
    """Every node (started) joins round 0; node rank 0 asks a restart; every node (but the
    last, where `lose`) joins round 1: each node's two rounds."""
    first = await asyncio.gather(*(c.join(member(c)) for c in coordinators))
    ended = [c.ended(rnd) for c, rnd in zip(coordinators, first, strict=True)]
    leader = next(c for c, rnd in zip(coordinators, first, strict=True) if rnd.group_rank == 0)
    await leader.request(leader.round, new_request("restart", "a rank failed", leader.node_id))
    await asyncio.wait_for(asyncio.gather(*ended), 30)
    going = coordinators[:-1] if lose else coordinators
    second = await asyncio.wait_for(asyncio.gather(*(c.join(member(c)) for c in going)), 60)
    return first, second


def assert_one_round(rounds: list[Round], nodes: int) -> None:
    assert {r.number for r in rounds} == {1}
    assert len({r.members for r in rounds}) == 1 and len(rounds[0].members) == nodes
    assert sorted(r.group_rank for r in rounds) == list(range(nodes))


def c10d_coordinators(port: int, nodes: int) -> list[Any]:
    from ftd.coordination.c10d.coordinator import StoreCoordinator

    endpoint = f"127.0.0.1:{port}"
    return [StoreCoordinator(c.model_copy(update={"rdzv_endpoint": endpoint}), secret=SECRET)
            for c in configs(nodes)]  # fmt: skip


@pytest.mark.parametrize("lose", [False, True])
async def test_c10d_round_1s_members_rebuild_it_from_round_0s(
    lose: bool, rebuilt: list[bool]
) -> None:
    from ftd_client.store import tcp_store_server

    port = free_port()
    server = tcp_store_server("127.0.0.1", port)
    coordinators = c10d_coordinators(port, 4)
    try:
        first, second = await restarted(await started(coordinators), lose)
        assert_one_round(second, 3 if lose else 4)
        assert [r.members[:2] for r in second] == [first[0].members[:2]] * len(second)
        assert rebuilt == [True] * len(second)  # every member, from the delta
    finally:
        for coordinator in coordinators:
            await coordinator.close()
        del server


async def test_c10d_a_forged_or_junk_delta_costs_a_whole_read_not_the_round(
    rebuilt: list[bool],
) -> None:
    """Junk at the delta's key moves it down its chain; a delta signed but wrong (a digest that
    is not the members') is in force first: every member finds it does not rebuild the round,
    counts it and reads the closing record whole."""
    from ftd_client.store import tcp_store_server

    port = free_port()
    server = tcp_store_server("127.0.0.1", port)
    coordinators = c10d_coordinators(port, 3)
    forged = delta_of(closed(1, [row(1)]), closed(0, [row(1)]))
    try:

        def forge(s: Any) -> None:
            s.set(key(1, DELTA), "junk")
            s.put(f"{key(1, DELTA)}#1", forged)

        await (await started(coordinators))[0]._connections.call(forge)
        _, second = await restarted(coordinators, lose=False)
        assert_one_round(second, 3)
        assert rebuilt == [False] * 3
        assert all(c.codec.refused["bad_round_delta"] == 1 for c in coordinators)
    finally:
        for coordinator in coordinators:
            await coordinator.close()
        del server


@pytest.mark.parametrize("lose", [False, True])
async def test_etcd_round_1s_members_rebuild_it_from_round_0s(
    lose: bool, rebuilt: list[bool], etcd: ClusterFactory
) -> None:
    from ftd.coordination.etcd.coordinator import EtcdCoordinator

    endpoint = (await etcd(1)).rdzv_endpoint
    update = {"rdzv_backend": "etcd", "rdzv_endpoint": endpoint}
    coordinators = [
        EtcdCoordinator(c.model_copy(update=update), SECRET, lambda k, d: None) for c in configs(4)
    ]
    try:
        _, second = await restarted(await started(coordinators), lose)
        assert_one_round(second, 3 if lose else 4)
        assert rebuilt == [True] * len(second)
        assert all(c.codec.refused["bad_round_delta"] == 0 for c in coordinators)
    finally:
        for coordinator in coordinators:
            await coordinator.close()
