"""Fuzz target for the forward times and stragglers other nodes publish (NodeSummary.forward,
.stragglers in ftd.coordination.records, read by ftd.health.straggler_timer.peer_forward), and
the job's times node rank 0 writes from them (JobTimes, ftd.health.job_times): any
value at a `status/<node>` key gives a bounded summary or the codec's counted refusal, and the
job's forward times taken from the summaries that passed are well-formed, never an exception."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from ftd.coordination.base import cluster_answer
from ftd.coordination.records import (
    MAX_PUBLISHED_RANKS,
    MAX_RECORD_BYTES,
    JobTimes,
    NodeSummary,
    RankForward,
    RankStraggler,
    RecordCodec,
)
from ftd.health.job_times import times_of
from ftd.health.straggler_timer import MAX_PEER_RANKS, peer_forward
from tests.support.fuzzing import budget, fuzz_target

KEY = "status/node-b"
SIGNED = RecordCodec("job", b"the job's secret")

_number = st.one_of(
    st.integers(-(2**64), 2**64),
    st.floats(),
    st.none(),
    st.booleans(),
    st.text(max_size=8),
    st.sampled_from([0, 1, 62000, 2**40, -1, 1e308, "nan"]),
)
_entry = st.one_of(
    st.fixed_dictionaries({"global_rank": _number, "forward_us": _number}),
    st.fixed_dictionaries({"global_rank": _number, "ratio": _number, "since": _number}),
    st.dictionaries(st.text(max_size=12), _number, max_size=4),
    _number,
)
_summary = st.fixed_dictionaries(
    {
        "node_id": st.just("node-b"),
        "state": st.just("running"),
        "attempt": st.just(0),
        "restart_count": st.just(0),
        "group_rank": st.just(1),
        "nproc_per_node": st.just(1),
        "time": st.just(1.0e9),
    },
    optional={
        "forward": st.lists(st.lists(_number | st.none(), max_size=4) | _entry, max_size=8)
        | st.integers(0, 2000).map(lambda n: [[n, 1, None]] * n),
        "stragglers": st.lists(_entry, max_size=8) | _number,
    },
)


def _mangle(body: bytes, cut: int, junk: bytes) -> bytes:
    return body[: cut % (len(body) + 1)] + junk if cut % 4 == 0 else body


def _signed(summary: dict[str, Any], cut: int, junk: bytes) -> bytes:
    body = _mangle(json.dumps(summary).encode(), cut, junk)
    mac = SIGNED._mac(KEY, body)
    return b"ftd1 " + mac.encode() + b" " + body


@fuzz_target("store_records", 200)
@given(_summary, st.integers(0, 10_000), st.binary(max_size=4))
def test_fuzz_published_forward_times(summary: dict[str, Any], cut: int, junk: bytes) -> None:
    data = _signed(summary, cut, junk)  # signed by the job: only the decoder's bounds stand
    refused = sum(SIGNED.refused.values())
    with budget():
        record = SIGNED.decode(KEY, data, NodeSummary)
        nodes = [record.model_dump()] if record is not None else []
        answer = cluster_answer(nodes, None, {}, 0, {})
        forward = peer_forward(answer, "node-a")
    if record is None:
        assert sum(SIGNED.refused.values()) == refused + 1
        assert forward == {} and answer["stragglers"] == []
        return
    assert len(data) <= MAX_RECORD_BYTES
    assert len(record.forward) <= MAX_PUBLISHED_RANKS >= len(record.stragglers)
    assert all(isinstance(f, RankForward) for f in record.forward)
    assert all(isinstance(s, RankStraggler) for s in record.stragglers)
    assert len(forward) <= MAX_PEER_RANKS
    for rank, seconds in forward.items():
        assert rank >= 0 and 0 <= seconds < 2**40 / 1e6
    for straggler in answer["stragglers"]:
        assert straggler["node_id"] == "node-b" and straggler["ratio"] >= 0


_job_times = st.fixed_dictionaries(
    {"round": _number | st.just(3), "time": _number | st.just(1.0e9)},
    optional={
        "forward": st.lists(st.lists(_number | st.none(), max_size=4) | _entry, max_size=8)
        | st.integers(0, 2000).map(lambda n: [[n, 1, None]] * n),
    },
)


@fuzz_target("store_records", 200)
@given(_job_times, st.integers(0, 10_000), st.binary(max_size=4))
def test_fuzz_the_job_times_record(times: dict[str, Any], cut: int, junk: bytes) -> None:
    """The value at the `job_times` key (node rank 0's, ftd.health.job_times): a bounded
    JobTimes or a counted refusal; what a node takes from it is well-formed."""
    body = _mangle(json.dumps(times).encode(), cut, junk)
    data = b"ftd1 " + SIGNED._mac("job_times", body).encode() + b" " + body
    refused = sum(SIGNED.refused.values())
    with budget():
        record = SIGNED.decode("job_times", data, JobTimes)
        taken = times_of(record.model_dump()["forward"] if record is not None else ())
    if record is None:
        assert sum(SIGNED.refused.values()) == refused + 1
        return
    assert len(record.forward) <= MAX_PUBLISHED_RANKS and record.round >= 0
    for seconds_by_rank in taken.values():
        assert all(rank >= 0 and 0 <= s < 2**40 / 1e6 for rank, s in seconds_by_rank.items())
