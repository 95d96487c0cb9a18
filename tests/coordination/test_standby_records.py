"""The standby records a cluster view reads (ftd/coordination/standby.py) are hostile store
values like any other: a forged, oversized or invalid one is skipped and counted, a forged
counter reads no more than MAX_STANDBYS_READ slots, a member is active whatever a record says;
and the view's roles, for any value at a standby's key (fuzz target)."""

from __future__ import annotations

import json
import time

from hypothesis import given
from hypothesis import strategies as st

from ftd.config.serve import ServeConfig
from ftd.coordination.base import Round
from ftd.coordination.c10d.record_store import RecordStore
from ftd.coordination.c10d.rounds import StoreRounds
from ftd.coordination.records import MAX_RECORD_BYTES, RecordCodec, RoundMember, RoundRecord
from ftd.coordination.shared_rounds import Late
from ftd.coordination.standby import (
    MAX_STANDBYS_READ,
    StandbyRecord,
    cluster_nodes,
    viewed_round,
)
from tests.conftest import free_port
from tests.support.fuzzing import budget, fuzz_target

SECRET = b"s" * 32
KEY = "r0/standby/1"
SIGNED = RecordCodec("job", SECRET)


def _member(node_id: str) -> RoundMember:
    return RoundMember(node_id, "127.0.0.1", 1, 1)


def _round(*members: str) -> Round:
    return Round.of_members(0, tuple(_member(m) for m in members), 0, 0, {})


def test_forged_and_oversized_standby_records_are_skipped_and_counted() -> None:
    from ftd_client.store import tcp_store_server

    port = free_port()
    server = tcp_store_server("127.0.0.1", port)
    config = ServeConfig(
        entrypoint=__file__,
        nnodes_min=2,
        nnodes_max=2,
        rdzv_endpoint=f"127.0.0.1:{port}",
        run_id="job",
        node_id="a",
    )
    codec = RecordCodec("job", SECRET)
    store = RecordStore("127.0.0.1", port, "ftd/job/", codec, 10)
    try:
        rounds = StoreRounds(config)
        store.add("r0/standby", 5)
        store.set("r0/standby/1", 'ftd1 - {"node_id": "mallory", "since": 1.0}')  # unsigned
        store.set("r0/standby/2", "ftd1 - " + "x" * (MAX_RECORD_BYTES + 1))
        forged = json.dumps({"node_id": "../etc", "since": 1.0}).encode()
        store.set("r0/standby/3", f"ftd1 {codec._mac('r0/standby/3', forged)} {forged.decode()}")
        store.put("r0/standby/4", StandbyRecord(node_id="b", since=1.0))  # b is a member
        far = f"r0/standby/{MAX_STANDBYS_READ + 1}"  # past the slots a view reads
        store.put(far, StandbyRecord(node_id="far", since=1.0))
        late = Late(0, RoundRecord(number=0, members=(_member("a"), _member("b")), restarts=0))
        spare = StoreRounds(config.model_copy(update={"node_id": "c"}))
        spare.stand_by(store, late, time.time())  # the 6th slot: the real standby
        nodes, _, _ = rounds.cluster_view(store, _round("a", "b"))
        assert {n["node_id"]: n["role"] for n in nodes} == {
            "a": "active",
            "b": "active",
            "c": "standby",
        }
        assert codec.refused["unsigned"] == 1
        assert codec.refused["oversized"] == 1
        assert codec.refused["invalid"] == 1
        store.add("r0/standby", 10**9)  # a forged counter: still MAX_STANDBYS_READ slots read
        started = time.monotonic()
        assert rounds.standbys(store, 0) == {"b", "c"}
        assert time.monotonic() - started < 10
        # The standby's own view: the round it waits for, itself a standby in it.
        mine = {n["node_id"]: n["role"] for n in spare.cluster_view(store, None)[0]}
        assert mine == {"a": "active", "b": "active", "c": "standby"}
    finally:
        store.close()
        del server


_value = st.one_of(
    st.integers(-(2**64), 2**64),
    st.floats(),
    st.none(),
    st.booleans(),
    st.text(max_size=300),
    st.sampled_from(["c", "a", "", "../x", "n" * 254, 1e308, -1.0]),
)
_record = st.one_of(
    st.fixed_dictionaries({"node_id": _value, "since": _value}),
    st.dictionaries(st.text(max_size=12), _value, max_size=4),
    _value,
)


@fuzz_target("store_records", 200)
@given(_record, st.booleans(), st.integers(0, 10_000), st.binary(max_size=8))
def test_fuzz_a_standby_record(record: object, sign: bool, cut: int, junk: bytes) -> None:
    """Any value at a standby's key: a bounded StandbyRecord or the codec's counted refusal,
    and a view whose roles are `active` for every member, `standby` for the rest."""
    body = json.dumps(record).encode()
    body = body[: cut % (len(body) + 1)] + junk if cut % 3 == 0 else body
    mac = SIGNED._mac(KEY, body) if sign else "-"
    data = b"ftd1 " + mac.encode() + b" " + body
    refused = sum(SIGNED.refused.values())
    view = viewed_round(_round("a", "b"), ("a", "b"), None, "a")
    with budget():
        found = SIGNED.decode(KEY, data, StandbyRecord)
        standbys = {found.node_id} if found is not None else set()
        nodes = cluster_nodes({}, view, standbys)
    if found is None:
        assert sum(SIGNED.refused.values()) == refused + 1
    else:
        assert sign and len(data) <= MAX_RECORD_BYTES
        assert 1 <= len(found.node_id) <= 253 and found.since >= 0
    assert len(nodes) <= len(view.members) + MAX_STANDBYS_READ + 1
    for node in nodes:
        member = node["node_id"] in view.members
        assert node["role"] == ("active" if member else "standby")
