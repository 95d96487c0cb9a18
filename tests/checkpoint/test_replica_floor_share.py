"""The replica floor without N² reads (issue 43 item 3): node rank 0 writes the two lowest
second-newest acknowledged steps and the nodes short of two; every node takes its own
`keep_from` out of that record, the same as reading every other node's summary would give."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ftd.checkpoint.ledger import replica_floor
from ftd.checkpoint.replica_ring import Ring, floor_for, floor_record
from ftd.coordination.records import ReplicaFloor
from ftd.refusals import Refusals

_steps = st.lists(st.integers(0, 50), max_size=4, unique=True).map(sorted)


@given(st.dictionaries(st.sampled_from("abcdefgh"), _steps, min_size=1), st.integers(0, 9))
def test_every_node_s_floor_from_the_record_is_the_floor_over_the_others(
    replicated: dict[str, list[int]], number: int
) -> None:
    ring = Ring(Refusals("replica"))
    ring.number, ring.members = number, sorted(replicated)
    ring.replicated = {node: tuple(steps) for node, steps in replicated.items()}
    record = ReplicaFloor.model_validate(floor_record(ring, 1.0)).model_dump()
    for me in ring.members:
        others = [ring.replicated[node] for node in ring.members if node != me]
        assert floor_for(record, me) == replica_floor(others), (me, record)


def test_no_record_keeps_everything() -> None:
    assert floor_for(None, "a") is None
