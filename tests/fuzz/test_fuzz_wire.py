"""Fuzz targets for what reaches the daemon over the network: rendezvous records (a TCPStore's
or etcd's values, ftd.coordination.records), etcd's answers (ftd.coordination.etcd.client.wire,
parsed by
transport.parse and turned into records by Namespace), and the REST API's request bodies and
headers (ftd.api.app.decode_body and its models, ftd.api.security). Each input gives a value or
the decoder's own refusal, never another exception, within a per-input CPU budget.

A short pass runs with the tests; the long one: `make fuzz-long` (docs/security.md).
"""

from __future__ import annotations

import base64
import contextlib
import json
import zlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from ftd.api.app import (
    ExcludeRequest,
    FaultRequest,
    RestartRequest,
    _check_seconds,
    _validate,
    decode_body,
)
from ftd.api.security import HostPolicy, bearer_token, host_of
from ftd.config.ft import RankTimeouts
from ftd.coordination.assignment import Assignment, ClosedMark, assignments_of
from ftd.coordination.etcd.client import wire
from ftd.coordination.etcd.client.errors import EtcdBadAnswer
from ftd.coordination.etcd.client.records import Delete, Get, Put
from ftd.coordination.etcd.client.transport import AttemptFailed, parse
from ftd.coordination.record_body import COMPRESS_FROM, BodyRefused, unpack
from ftd.coordination.records import (
    MAX_RECORD_BYTES,
    AliveRecord,
    ExcludedRecord,
    MarkRecord,
    Member,
    NodeSummary,
    RecordCodec,
    RequestRecord,
    RoundMember,
    RoundRecord,
)
from ftd.errors import InvalidRequest
from ftd.refusals import INPUT_REFUSED
from tests.support.fuzzing import budget, fuzz_target

# -- JSON that looks like the real thing, and mangled -------------------------------------------

_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=30),
    st.sampled_from(["", "0", "1", "-1", "9" * 25, "AAAA", "a2V5", "=", "node-a", "restart"]),
)
_json = st.recursive(
    _leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner),
    max_leaves=25,
)


def _mangle(data: bytes, cut: int, junk: bytes, at: int) -> bytes:
    """A cut, and junk spliced in: a value a full disk, a bug or an attacker left."""
    data = data[: cut % (len(data) + 1)] if cut % 3 == 0 else data
    at %= len(data) + 1
    return data[:at] + junk + data[at:]


def _mangled(good: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    return st.builds(
        _mangle, good, st.integers(0, 10_000), st.binary(max_size=6), st.integers(0, 10_000)
    )


def _deep(opener: bytes) -> st.SearchStrategy[bytes]:
    return st.integers(0, 100_000).map(lambda depth: opener * depth)


# -- rendezvous records ---------------------------------------------------------------------

_MODELS: list[type[BaseModel]] = [
    Member, RoundRecord, RequestRecord, AliveRecord, MarkRecord, ExcludedRecord, NodeSummary,
    Assignment, ClosedMark,
]  # fmt: skip
_member = Member(node_id="node-a", addr="10.0.0.1", nproc=2, store_port=29500)
_SAMPLES: list[tuple[str, BaseModel]] = [
    ("r/0/members/node-a", _member),
    ("r/round/3", RoundRecord(number=3, members=(RoundMember.of(_member),), restarts=1)),
    (
        "r/round/3/assigning",
        ClosedMark(
            number=3, record=RoundRecord(number=3, members=(RoundMember.of(_member),), restarts=1)
        ),
    ),
    (
        "r/round/3/assign/node-a",
        assignments_of(
            RoundRecord(number=3, members=(RoundMember.of(_member),), restarts=1),
            ["node-a"],
            list_max=0,
        )["node-a"],
    ),
    (  # long enough to be stored packed (record_body.py)
        "r/round/4/closed",
        RoundRecord(
            number=4,
            members=tuple(
                RoundMember.of(_member.model_copy(update={"node_id": f"node-{i:04d}"}))
                for i in range(200)
            ),
            restarts=1,
        ),
    ),
    ("r/round/3/request", RequestRecord(action="restart", reason="rank 1 failed", by="node-a")),
    ("r/alive/node-a", AliveRecord(seq=7)),
    ("r/round/3/mark/node-a", MarkRecord(node_id="node-a", reason="unhealthy")),
    ("r/excluded", ExcludedRecord(nodes={"node-b": "flaky"}, epoch=2)),
    (
        "r/summary/node-a",
        NodeSummary(
            node_id="node-a",
            state="running",
            attempt=1,
            restart_count=0,
            group_rank=0,
            nproc_per_node=2,
            time=1.0e9,
        ),
    ),
]
_SIGNED = RecordCodec("job", b"the job's secret")
_UNSIGNED = RecordCodec("job", None)


def _encoded(codec: RecordCodec) -> st.SearchStrategy[bytes]:
    return st.sampled_from(_SAMPLES).map(lambda s: codec.encode(s[0], s[1]).encode())


def _packed(body: bytes) -> bytes:
    """A body packed as record_body.pack packs it, whatever its length."""
    return b"z:" + base64.b64encode(zlib.compress(body))


def _framed(body: bytes, mac: bytes) -> bytes:
    return b"ftd1 " + mac + b" " + body


_record_bytes = st.one_of(
    st.binary(max_size=512),
    _mangled(_encoded(_SIGNED)),
    _mangled(_encoded(_UNSIGNED)),
    st.builds(_framed, _json.map(lambda v: json.dumps(v).encode()), st.just(b"-")),
    st.builds(_framed, _deep(b"[") | _deep(b'{"a":'), st.just(b"-")),
    st.builds(lambda n: b"ftd1 - " + b"9" * n, st.integers(1000, MAX_RECORD_BYTES + 10)),
    st.builds(
        _framed, _mangled(_json.map(lambda v: _packed(json.dumps(v).encode()))), st.just(b"-")
    ),
    st.builds(_framed, _deep(b"[").map(_packed), st.just(b"-")),  # a bomb of brackets
)


@fuzz_target("store_records", 200)
@given(_record_bytes, st.sampled_from(_MODELS), st.booleans())
def test_fuzz_rendezvous_records(data: bytes, model: type[BaseModel], signed: bool) -> None:
    codec = _SIGNED if signed else _UNSIGNED
    key = "r/round/3"
    with budget():
        record = codec.decode(key, data, model)  # type: ignore[type-var]
    if record is not None:
        assert isinstance(record, model)
        assert len(data) <= MAX_RECORD_BYTES
        if signed:  # only a record this codec signed for this key verifies
            assert data == codec.encode(key, record).encode()


def test_every_sample_round_trips() -> None:
    for codec in (_SIGNED, _UNSIGNED):
        for key, record in _SAMPLES:
            assert codec.decode(key, codec.encode(key, record), type(record)) == record
    packed = [k for k, r in _SAMPLES if b" z:" in _UNSIGNED.encode(k, r).encode()]
    assert packed == ["r/round/4/closed"]  # the fuzz above mangles a packed record too


_inflating = st.one_of(
    st.binary(max_size=256).map(lambda b: b"z:" + b),
    st.binary(max_size=4096).map(_packed),
    _mangled(st.binary(max_size=4096).map(_packed)),
    st.integers(0, 1 << 22).map(lambda n: _packed(b"\0" * n)),  # up to 4 MiB of zeros
    st.integers(0, 1 << 16).map(lambda n: _packed(b"x" * n) + b"tail"),
)


@fuzz_target("store_records", 200)
@given(_inflating, st.integers(0, 2 * COMPRESS_FROM))
def test_fuzz_packed_bodies(stored: bytes, max_bytes: int) -> None:
    """A packed body inflates within `max_bytes`, or is refused as oversized or malformed; a
    body that is not packed is its own JSON."""
    with budget():
        body = unpack(stored, max_bytes)
    if isinstance(body, BodyRefused):
        assert body.cause in ("oversized", "malformed")
    elif stored.startswith(b"z:"):
        assert len(body) <= max_bytes
    else:  # not packed: its own JSON (the codec bounded its length before)
        assert body == stored


# -- etcd's answers -------------------------------------------------------------------------

_ANSWERS: list[type[wire.Wire]] = [
    wire.RangeResponse, wire.PutResponse, wire.DeleteRangeResponse, wire.TxnResponse,
    wire.LeaseGrantResponse, wire.LeaseRevokeResponse, wire.AuthenticateResponse,
    wire.ErrorBody, wire.StreamRefusal, wire.KeepAliveLine, wire.WatchLine,
]  # fmt: skip
_PREFIX = b"/ftd/job/"


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


_header = st.fixed_dictionaries(
    {"revision": st.sampled_from(["1", "42", 42, "0", "-3", "x", 2**64])},
    optional={"member_id": st.sampled_from(["1", "18446744073709551615", "-1"])},
)
_kv = st.fixed_dictionaries(
    {"key": st.sampled_from([_b64(_PREFIX + b"round/1"), _b64(b"/other/x"), "!!", "", 3])},
    optional={
        "value": st.binary(max_size=40).map(_b64) | st.text(max_size=8),
        "mod_revision": st.sampled_from(["5", 5, "5.0", True]),
        "lease": st.sampled_from(["0", "7", "-7"]),
    },
)
_realistic = st.fixed_dictionaries(
    {"header": _header},
    optional={
        "kvs": st.lists(_kv, max_size=4),
        "count": st.sampled_from(["0", "3", 3]),
        "succeeded": st.booleans() | st.just("true"),
        "responses": st.lists(
            st.dictionaries(
                st.sampled_from(["response_range", "response_put", "response_delete_range"]),
                st.fixed_dictionaries({}, optional={"kvs": st.lists(_kv, max_size=2)}),
                max_size=2,
            ),
            max_size=3,
        ),
        "ID": st.sampled_from(["1", "0", "-1", 7]),
        "TTL": st.sampled_from(["10", "-1"]),
        "token": st.text(max_size=20),
        "result": st.fixed_dictionaries(
            {"header": _header},
            optional={
                "events": st.lists(
                    st.fixed_dictionaries({"kv": _kv}, optional={"type": st.just("DELETE")}),
                    max_size=3,
                ),
                "canceled": st.booleans(),
            },
        ),
        "error": st.one_of(_json, st.fixed_dictionaries({"grpc_code": st.integers(-1, 2000)})),
        "code": st.integers(-5, 2000),
    },
)
_answer_bytes = st.one_of(
    st.binary(max_size=400),
    _json.map(lambda v: json.dumps(v).encode()),
    _realistic.map(lambda v: json.dumps(v).encode()),
    _mangled(_realistic.map(lambda v: json.dumps(v).encode())),
    _deep(b"[") | _deep(b'{"header":'),
)


def _to_records(answer: wire.Wire) -> None:
    """What the client does with a parsed answer: take its keys out of the namespace."""
    space = wire.Namespace(_PREFIX)
    match answer:
        case wire.RangeResponse():
            space.range_result(answer, answer.header.revision)
        case wire.TxnResponse():
            ops = (Get(b"k"), Put(b"k", b"v"), Delete(b"k"))
            for op, result in zip(ops, answer.responses, strict=False):
                with contextlib.suppress(EtcdBadAnswer):  # another kind: the client's refusal
                    space.op_result(op, result, answer.header.revision)
        case wire.WatchLine(result=wire.WatchResult() as result):
            for event in result.events:
                space.event(event)


@fuzz_target("etcd_responses", 200)
@given(_answer_bytes, st.sampled_from(_ANSWERS))
def test_fuzz_etcd_answers(data: bytes, answer: type[wire.Wire]) -> None:
    with budget():
        try:
            parsed = parse(answer, data)
        except AttemptFailed as failed:
            assert failed.bad_answer and "\n" not in str(failed) and len(str(failed)) < 600
            return
        try:
            _to_records(parsed)
        except EtcdBadAnswer as error:
            assert "outside the prefix" in str(error) and len(str(error)) < 600
    assert isinstance(parsed, answer)


# -- the REST API's bodies and headers --------------------------------------------------------

_BODIES: list[type[BaseModel] | None] = [RestartRequest, FaultRequest, ExcludeRequest, None]
_request_like = st.fixed_dictionaries(
    {},
    optional={
        "scope": st.sampled_from(["cluster", "node", "x", 1]),
        "reason": st.text(max_size=1100) | st.just("a\x1b[2J"),
        "count": _leaf,
        "kind": st.sampled_from(["kill", "hang", "KILL"]),
        "rank": st.sampled_from([0, 3.0, 3.5, "random", -1, True, 2**70]),
        "delay_s": _leaf,
        "rank_heartbeat_timeout": _leaf,
        "rank_section_timeouts": st.dictionaries(st.text(max_size=20), _leaf, max_size=5) | _leaf,
        "initial_rank_heartbeat_timeout": _leaf,
        "calc_timeouts": _leaf,
    },
)
_body_bytes = st.one_of(
    st.binary(max_size=400),
    _json.map(lambda v: json.dumps(v).encode()),
    _request_like.map(lambda v: json.dumps(v).encode()),
    _mangled(_request_like.map(lambda v: json.dumps(v).encode())),
    _deep(b"[") | _deep(b'{"a":'),
    st.sampled_from([b"NaN", b'{"delay_s": Infinity}', b"\xff\xfe", b"  \n ", b"[]"]),
)


def _apply(model: type[BaseModel] | None, body: dict[str, Any]) -> object:
    if model is not None:
        return _validate(model, body)
    _check_seconds(body)  # PATCH /v1/timeouts, as the daemon takes it
    return RankTimeouts.model_validate({**RankTimeouts().model_dump(), **body})


@fuzz_target("http", 200)
@given(_body_bytes, st.sampled_from(_BODIES))
def test_fuzz_api_bodies(data: bytes, model: type[BaseModel] | None) -> None:
    with budget():
        try:
            _apply(model, decode_body(data))
        except InvalidRequest as refused:
            assert str(refused) and len(str(refused)) < 20_000
        except ValueError as error:  # RankTimeouts' own ValidationError: the daemon's 400
            assert model is None and "validation error" in str(error)


_header_text = st.one_of(
    st.text(max_size=200),
    st.sampled_from(["Bearer ", "bearer x", "Basic abc", "localhost:8080", "[::1]:1", "[::1"]),
    st.builds(lambda a, b: a + b, st.sampled_from(["Bearer ", "127.0.0.1:", "["]), st.text()),
    st.integers(0, 100_000).map(lambda n: "Bearer " + "a" * n),
)
_POLICIES = [
    HostPolicy.for_bind("127.0.0.1", ["127.0.0.1"]),
    HostPolicy.for_bind("ftd.local", ["::1"]),
    HostPolicy.for_bind("0.0.0.0", ["0.0.0.0"]),
]


@fuzz_target("http", 200)
@given(st.lists(_header_text, max_size=4))
def test_fuzz_api_headers(headers: list[str]) -> None:
    with budget():
        for header in headers:
            token = bearer_token(header)
            assert token is None or (token and all("!" <= c <= "~" for c in token))
            host = host_of(header)
            assert host is None or (host.isascii() and host == host.lower())
        for policy in _POLICIES:
            allowed = policy.allows(headers)
            assert allowed or policy.loopback_only


@pytest.mark.parametrize("model", _BODIES)
def test_a_valid_body_of_each_kind_is_accepted(model: type[BaseModel] | None) -> None:
    bodies: dict[type[BaseModel] | None, bytes] = {
        RestartRequest: b'{"scope": "node", "reason": "drain"}',
        FaultRequest: b'{"kind": "hang", "rank": 1.0}',
        ExcludeRequest: b"{}",
        None: b'{"rank_heartbeat_timeout": 30, "rank_section_timeouts": {"step": 10}}',
    }
    assert _apply(model, decode_body(bodies[model])) is not None


def test_every_refusal_is_counted_in_one_metric() -> None:
    def count(source: str, cause: str) -> float:
        return INPUT_REFUSED.labels(source, cause)._value.get()

    before = count("rendezvous_store", "unsigned")
    assert _SIGNED.decode("r/alive/node-a", b'ftd1 - {"seq": 1}', AliveRecord) is None
    assert count("rendezvous_store", "unsigned") == before + 1
    before = count("etcd", "not_PutResponse")
    with pytest.raises(AttemptFailed):
        parse(wire.PutResponse, b'{"header": {}}')
    assert count("etcd", "not_PutResponse") == before + 1
