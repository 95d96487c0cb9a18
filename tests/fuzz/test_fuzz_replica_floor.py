"""Fuzz target for node rank 0's replica floor record (`aggregate/replica_floor`: ReplicaFloor in
ftd.coordination.records, read by every other node, ftd.checkpoint.replica_ring.floor_for): any
value at the key gives a bounded record or the codec's counted refusal, and the floor a node
takes from an accepted one is a step or None, never an exception."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from ftd.checkpoint.replica_ring import floor_for
from ftd.coordination.records import RecordCodec, ReplicaFloor
from tests.support.fuzzing import budget, fuzz_target

KEY = "aggregate/replica_floor"
SIGNED = RecordCodec("job", b"the job's secret")
_value = st.one_of(
    st.integers(-(2**64), 2**64), st.floats(), st.none(), st.booleans(), st.text(max_size=8)
)
_step = st.fixed_dictionaries(
    {"node_id": st.sampled_from(["a", "b", "", "x" * 300]), "step": _value}
)
_record = st.fixed_dictionaries(
    {"round": _value | st.just(1), "time": _value | st.just(1.0)},
    optional={
        "lowest": st.lists(_step | _value, max_size=4),
        "short": st.lists(st.sampled_from(["a", "b", ""]) | _value, max_size=4),
    },
)


@fuzz_target("store_records", 200)
@given(_record, st.sampled_from(["a", "b", "c"]))
def test_fuzz_the_replica_floor_record(record: dict[str, Any], me: str) -> None:
    body = json.dumps(record).encode()
    data = b"ftd1 " + SIGNED._mac(KEY, body).encode() + b" " + body
    refused = sum(SIGNED.refused.values())
    with budget():
        decoded = SIGNED.decode(KEY, data, ReplicaFloor)
        floor = floor_for(decoded.model_dump() if decoded is not None else None, me)
    if decoded is None:
        assert sum(SIGNED.refused.values()) == refused + 1 and floor is None
        return
    assert len(decoded.lowest) <= 2 >= len(decoded.short)
    assert floor is None or 0 <= floor <= 2**53
