"""Fuzz target for the job's culprit records (`r<N>/collectives/<node>`: Collectives, read by
node rank 0; `r<N>/culprit`: JobCulprit, read by every node; ftd.coordination.job_culprit): any
value at those keys gives a bounded record or the codec's counted refusal, and the decision taken
from accepted ones is a bounded record or None, never an exception."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from ftd.coordination.job_culprit import decide
from ftd.coordination.records import Collectives, JobCulprit, RecordCodec
from tests.support.fuzzing import budget, fuzz_target

SIGNED = RecordCodec("job", b"the job's secret")
_value = st.one_of(
    st.integers(-(2**64), 2**64), st.floats(), st.none(), st.booleans(), st.text(max_size=8)
)
_node = st.sampled_from(["a", "b", "", "x" * 300, "../a"])
_collectives = st.fixed_dictionaries(
    {"round": _value | st.just(3), "node_id": _node, "group_rank": _value | st.just(1)},
    optional={
        "lowest": _value | st.integers(0, 9),
        "rank": _value | st.integers(0, 9),
        "since": _value,
        "waiting": _value,
        "ranks": _value,
        "judged": _value,
        "extra": _value,
    },
)
_culprit = st.fixed_dictionaries(
    {
        "round": _value | st.just(3),
        "node_id": _node,
        "group_rank": _value,
        "rank": _value | st.just(2),
        "entered": _value,
        "waiting_nodes": _value,
        "nodes": _value,
        "reason": st.text(max_size=20) | _value,
        "time": _value | st.just(1.0),
    }
)


def _signed(key: str, record: dict[str, Any]) -> bytes:
    body = json.dumps(record).encode()
    return b"ftd1 " + SIGNED._mac(key, body).encode() + b" " + body


@fuzz_target("store_records", 200)
@given(st.lists(_collectives, max_size=6), _culprit)
def test_fuzz_the_collectives_and_the_decision(
    found: list[dict[str, Any]], culprit: dict[str, Any]
) -> None:
    refused = sum(SIGNED.refused.values())
    with budget():
        accepted = [
            SIGNED.decode(
                f"r3/collectives/{i}", _signed(f"r3/collectives/{i}", record), Collectives
            )
            for i, record in enumerate(found)
        ]
        decision = decide(3, [c for c in accepted if c is not None], 2.0)
        read = SIGNED.decode("r3/culprit", _signed("r3/culprit", culprit), JobCulprit)
    missing = sum(c is None for c in accepted) + (read is None)
    assert sum(SIGNED.refused.values()) == refused + missing
    if decision is not None:
        JobCulprit.model_validate(decision.model_dump())
        assert len(decision.reason) <= 4000
