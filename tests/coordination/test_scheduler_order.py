"""Nodes in the scheduler's order (issue 40 item 5): a node that gives its scheduler rank
(--node-rank, SLURM_NODEID, a pod's index) is ranked by it in every round, so a node that
replaces another under the same scheduler rank takes its place and the others keep theirs."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ftd.coordination.base import order_members
from ftd.coordination.records import Member
from tests.conftest import Backend, ServeFactory, events_in
from tests.support.cluster import Cluster, run_dir


def member(node_id: str, order: int | None = None) -> Member:
    return Member(node_id=node_id, addr="127.0.0.1", nproc=1, store_port=1, order=order)


def test_the_scheduler_order_wins_over_joining_and_the_previous_round() -> None:
    joined = [member("z", 0), member("new"), member("a", 2), member("old")]
    ranked = order_members(joined, previous=["old", "a", "z"])
    assert [m.node_id for m in ranked] == ["z", "a", "old", "new"]
    replaced = order_members([member("spare", 2), member("z", 0)], previous=["z", "a"])
    assert [m.node_id for m in replaced] == ["z", "spare"]  # the replacement takes a's place


@given(
    st.lists(st.tuples(st.sampled_from("abcdefgh"), st.none() | st.integers(0, 5)), max_size=12),
    st.permutations(list("abcdefgh")),
)
def test_nodes_with_a_scheduler_rank_come_first_in_its_order(
    joins: list[tuple[str, int | None]], previous: list[str]
) -> None:
    ranked = order_members([member(n, o) for n, o in joins], previous)
    ids = [m.node_id for m in ranked]
    assert len(ids) == len(set(ids)) == len({n for n, _ in joins})
    orders = [m.order for m in ranked]
    with_rank = [o for o in orders if o is not None]
    assert orders[: len(with_rank)] == with_rank == sorted(with_rank)
    rest = [m.node_id for m in ranked if m.order is None]
    assert rest == sorted(rest, key=previous.index)


async def test_a_node_that_joins_first_still_takes_its_scheduler_rank(
    serve: ServeFactory, backend: Backend
) -> None:
    cluster = Cluster(serve, "2", "--max-restarts", "0", backend=backend)
    a = await cluster.node("a", flags=("--node-rank", "1"))
    await a.stderr.expect(cluster.backend.in_rendezvous)
    b = await cluster.node("b", flags=("--node-rank", "0"))
    assert await a.wait() == 0 and await b.wait() == 0
    [closed] = events_in(run_dir(a, "a"), "round_closed")
    assert closed["data"]["members"] == ["b", "a"], closed
