"""Long records are stored packed (ftd/coordination/record_body.py): round 0's closing record,
read by every node, 8-10 times smaller; what inflates is bounded, and in a signed job only what
carries the job's MAC is inflated at all. Feature and attacks on both backends' real stores."""

from __future__ import annotations

import asyncio
import base64
import os
import zlib

from ftd.coordination.c10d.record_store import RecordStore
from ftd.coordination.etcd.client import EtcdClient
from ftd.coordination.etcd.kv import Availability, RecordKv
from ftd.coordination.record_body import COMPRESS_FROM, PACKED, BodyRefused, pack, unpack
from ftd.coordination.records import (
    MAX_ROUND_RECORD_BYTES,
    RecordCodec,
    RoundMember,
    RoundRecord,
)
from tests.conftest import free_port
from tests.support.etcd_cluster import ClusterFactory

SECRET = b"the job's secret"
KEY = "r1/closed"


def _round(nodes: int, number: int = 1) -> RoundRecord:
    rows = tuple(RoundMember(f"node-{i:05d}.cluster.local", f"10.0.{i >> 8}.{i & 255}", 8, 29500)
                 for i in range(nodes))  # fmt: skip
    return RoundRecord(number=number, members=rows, restarts=0)


def _bomb(codec: RecordCodec, key: str, inflated: int) -> bytes:
    """`inflated` zero bytes packed, signed as a node of the job (it holds the secret) would."""
    body = PACKED + base64.b64encode(zlib.compress(b"\0" * inflated, 9))
    mac = codec._mac(key, body) if codec.signed else "-"
    return b"ftd1 " + mac.encode() + b" " + body


def test_short_bodies_stay_json_and_long_ones_are_packed_smaller() -> None:
    short = b'{"seq":7}'
    assert pack(short) == short and unpack(short, 100) == short
    codec = RecordCodec("job", SECRET)
    record = _round(1024)
    stored = codec.encode(KEY, record)
    json_bytes = len(record.model_dump_json())
    assert json_bytes > 50_000 and len(stored) < json_bytes / 6  # real names: ~8x
    assert stored.isascii() and "\n" not in stored and " z:" in stored
    assert codec.decode(KEY, stored, RoundRecord, MAX_ROUND_RECORD_BYTES) == record
    noise = base64.b64encode(os.urandom(COMPRESS_FROM))  # packs no shorter: kept as is
    assert pack(noise) == noise


def test_packing_is_deterministic_for_compare_and_set() -> None:
    record = _round(300)
    assert RecordCodec("job", SECRET).encode(KEY, record) == RecordCodec("job", SECRET).encode(
        KEY, record
    )


def test_a_packed_body_is_verified_before_it_is_inflated() -> None:
    codec = RecordCodec("job", SECRET)
    forged = _bomb(RecordCodec("job", b"another secret"), KEY, 64 << 20)
    assert codec.decode(KEY, forged, RoundRecord, MAX_ROUND_RECORD_BYTES) is None
    assert codec.refused["bad_signature"] == 1 and codec.refused["oversized"] == 0


def test_malformed_packed_bodies_are_refused_by_cause() -> None:
    whole = pack(_round(300).model_dump_json().encode())
    assert isinstance(cut := unpack(whole[: len(whole) // 2], 1 << 20), BodyRefused)
    assert cut.cause == "malformed"
    assert isinstance(text := unpack(PACKED + b"not base64!", 1 << 20), BodyRefused)
    assert text.cause == "malformed"
    assert isinstance(tail := unpack(whole + base64.b64encode(b"more"), 1 << 20), BodyRefused)
    assert tail.cause == "malformed"
    assert isinstance(big := unpack(whole, 1000), BodyRefused) and big.cause == "oversized"


def test_a_signed_bomb_in_the_tcpstore_is_refused_and_the_genuine_record_read() -> None:
    from ftd_client.store import tcp_store_server

    port = free_port()
    server = tcp_store_server("127.0.0.1", port)
    codec = RecordCodec("job", SECRET)
    store = RecordStore("127.0.0.1", port, "ftd/job/", codec, 10)
    try:
        store.set(KEY, _bomb(codec, KEY, MAX_ROUND_RECORD_BYTES + 1))
        assert store.read(KEY, RoundRecord, MAX_ROUND_RECORD_BYTES) is None
        assert codec.refused["oversized"] == 1
        genuine = _round(1024)
        store.set(KEY, codec.encode(KEY, genuine))
        assert store.read(KEY, RoundRecord, MAX_ROUND_RECORD_BYTES) == genuine
    finally:
        store.close()
        del server


async def test_a_signed_bomb_in_etcd_is_stepped_over_by_a_decision(etcd: ClusterFactory) -> None:
    cluster = await etcd(1)
    codec = RecordCodec("job", SECRET)
    genuine = _round(1024)
    async with EtcdClient(cluster.endpoints, prefix="ftd/job/") as client:
        kv = RecordKv(client, codec, Availability(lambda kind, data: None, "etcd"))
        await client.put(KEY, _bomb(codec, KEY, MAX_ROUND_RECORD_BYTES + 1))
        # A decision steps over a value that is not a valid record (records.py): the bomb.
        decided = await kv.decide(KEY, genuine, RoundRecord, MAX_ROUND_RECORD_BYTES)
        assert decided == genuine
        found, _ = await asyncio.wait_for(
            kv.await_decided(KEY, RoundRecord, MAX_ROUND_RECORD_BYTES), 30
        )
        assert found == genuine
    assert codec.refused["oversized"] >= 1
