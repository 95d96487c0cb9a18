"""Exclusion and readmission cannot be rolled back (issue 23, item 6): someone who can write to
the rendezvous store but has no secret replays an older signed `excluded` record (one from
before the node's exclusion) and deletes `excluded/<node>`; the excluded node must still be
refused, and the job it tried to rejoin must not restart for it."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from ftd.coordination.etcd.client import EtcdClient
from ftd.coordination.exclusion_ledger import ExclusionLedger
from ftd.coordination.records import (
    ExcludedRecord,
    RecordCodec,
    RoundRecord,
)
from tests.conftest import Backend, ServeFactory
from tests.support.cluster import Attacker, Cluster, api, ready_together

pytestmark = pytest.mark.timeout(240)

Raw = tuple[Callable[[str], Awaitable[bytes]], Callable[[str, bytes], Awaitable[None]]]


def test_the_ledger_never_goes_back_to_an_older_epoch() -> None:
    codec = RecordCodec("job", b"s" * 32)
    ledger = ExclusionLedger()
    assert ledger.merge(ExcludedRecord(nodes={"b": "why"}, epoch=3), codec) == {"b": "why"}
    assert ledger.merge(ExcludedRecord(nodes={}, epoch=2), codec) == {"b": "why"}  # replayed
    assert codec.refused["rolled_back"] == 1
    assert ledger.merge(None, codec) == {"b": "why"}  # deleted
    readmitted = ledger.updated(ExcludedRecord(nodes={}, epoch=2), "b", None)
    assert readmitted == ExcludedRecord(nodes={}, epoch=4)  # past both the store's and ours
    assert ledger.merge(readmitted, codec) == {}
    ledger.learn(RoundRecord(number=9, members=(), restarts=0, excluded={"c": "x"}))
    assert ledger.nodes == {}  # a round record without an epoch teaches nothing
    ledger.learn(
        RoundRecord(number=9, members=(), restarts=0, excluded={"c": "x"}, excluded_epoch=5)
    )
    assert ledger.nodes == {"c": "x"}


@contextlib.asynccontextmanager
async def _raw_access(cluster: Cluster, backend: Backend) -> AsyncIterator[Raw]:
    """(get, set; an empty value deletes) of a key under the job's prefix, as someone with the
    store's address or etcd's, and no secret, has them."""
    if backend.etcd is None:
        attacker = await asyncio.to_thread(Attacker, cluster.endpoint, cluster.job)

        async def get(key: str) -> bytes:
            return await asyncio.to_thread(attacker.get, key)

        async def put(key: str, value: bytes) -> None:
            if value:
                await asyncio.to_thread(attacker.set, key, value)
            else:
                await asyncio.to_thread(attacker.store.delete_key, key)

        yield get, put
        return
    async with EtcdClient(backend.etcd.endpoints, prefix=f"/ftd/{cluster.job}/") as client:

        async def etcd_get(key: str) -> bytes:
            found = await client.get(key)
            assert found is not None, key
            return bytes(found.value)

        async def etcd_put(key: str, value: bytes) -> None:
            if value:
                await client.put(key, value)
            else:
                await client.delete(key)

        yield etcd_get, etcd_put


async def test_a_replayed_excluded_record_readmits_no_one(
    serve: ServeFactory, backend: Backend
) -> None:
    cluster = Cluster(serve, "1:2", backend=backend)
    a = await cluster.first("a", "--hang")
    b = await cluster.node("b", "--hang")
    n = await ready_together(a, b)
    async with _raw_access(cluster, backend) as (get, put):
        code, body = await api(a, "a", "POST", "/v1/nodes/b/exclude")
        assert code == 202, body
        assert await b.wait(timeout=60) == 1
        await a.stdout.expect(rf"ready a{n + 1} r0")
        code, body = await api(a, "a", "DELETE", "/v1/nodes/b/exclude")
        assert code == 200, body
        before = await _wait_for_value(get, "excluded", lambda raw: b'"b"' not in raw)
        # b comes back (a scales up), then is excluded a second time.
        b = await cluster.node("b", "--hang")
        m = await ready_together(a, b)
        code, body = await api(a, "a", "POST", "/v1/nodes/b/exclude")
        assert code == 202, body
        assert await b.wait(timeout=60) == 1
        await a.stdout.expect(rf"ready a{m + 1} r0")
        # The attack: the signed record from before, and no mark for b.
        await put("excluded", before)
        await put("excluded/b", b"")
        again = await cluster.node("b", "--hang")
        assert await again.wait(timeout=60) == 1
        assert "node b is excluded from job job" in again.stderr.text
        assert f"ready a{m + 2}" not in a.stdout.text  # a was not restarted for it
        code, view = await api(a, "a", "GET", "/v1/cluster")
        assert code == 200
        assert [e["node_id"] for e in view["excluded"]] == ["b"]  # type: ignore[attr-defined]
    a.signal(signal.SIGTERM)
    assert await a.wait() == 128 + signal.SIGTERM


async def _wait_for_value(
    get: Callable[[str], Awaitable[bytes]], key: str, done: Callable[[bytes], bool]
) -> bytes:
    for _ in range(300):
        raw = await get(key)
        if done(raw):
            return raw
        await asyncio.sleep(0.1)
    raise AssertionError(f"{key} never changed: {raw!r}")
