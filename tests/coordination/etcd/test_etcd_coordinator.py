"""What only the etcd backend does: its members failing (the leader, a quorum), leases as node
liveness, node rank 0 dying without taking the store along, hostile values under the job's
prefix, and its --rdzv-conf. Real etcd members (tests/support/etcd_cluster.py), real daemons.

The behaviours both backends share are tests/coordination/test_multinode.py's, run through both.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ftd.config.serve import ServeConfig
from ftd.coordination.base import CoordinationError, new_request
from ftd.coordination.etcd.client import EtcdClient
from ftd.coordination.etcd.conf import parse_etcd_conf
from ftd.coordination.etcd.coordinator import EtcdCoordinator
from ftd.coordination.etcd.rounds import RoundHint
from ftd.coordination.records import (
    ExcludedRecord,
    Member,
    RecordCodec,
    RequestRecord,
    RoundMember,
    RoundRecord,
)
from tests.conftest import ROOT, WORKER, Backend, Serve, ServeFactory, events_in, wait_pids_gone
from tests.support.cluster import Cluster, ranks_of, run_dir, two_nodes_in_a_round
from tests.support.etcd_cluster import ClusterFactory

pytestmark = pytest.mark.timeout(150)

SECRET = b"a job secret of thirty-two bytes!"


def kinds(run: Serve, node: str, *wanted: str) -> list[tuple[str, dict[str, Any]]]:
    """The node's events of these kinds, in order: (kind, data)."""
    lines = (run_dir(run, node) / "events.jsonl").read_text().splitlines()
    found = [json.loads(line) for line in lines]
    return [(e["kind"], e["data"]) for e in found if e["kind"] in wanted]


async def ready_together(runs: dict[str, Serve], last: str) -> int:
    """The attempt in which every node's rank is up: the one `last` (the highest rank) is up
    in; earlier ranks of that attempt are awaited too."""
    order = sorted(runs)
    match = await runs[last].stdout.expect(rf"ready a(\d+) r{order.index(last)}")
    n = int(match.group(1))
    for rank, node in enumerate(order):
        await runs[node].stdout.expect(rf"ready a{n} r{rank}")
    return n


async def test_etcd_leader_and_node_rank_0_die_a_member_returns_a_node_joins(
    serve: ServeFactory, etcd: ClusterFactory, tmp_path: Path
) -> None:
    """Three daemons on three etcd members. The etcd leader is SIGKILLed (the job does not
    notice), then node rank 0's daemon (the survivors form a new round, node b hosting the
    workers' store), then the etcd member comes back and a fourth node joins (the job scales up):
    the survivors finish with 0, and every step is in their events."""
    members = await etcd(3)
    leader = await members.leader()
    first = members.members[leader]  # listed first: every daemon talks to it
    others = [m for i, m in enumerate(members.members) if i != leader]
    endpoint = ",".join(f"127.0.0.1:{m.client_port}" for m in [first, *others])
    # A long read_timeout: on a busy machine a slow answer could move a daemon to another
    # member before the kill (then it has nothing to notice).
    conf = ("--rdzv-conf", "read_timeout=15")
    cluster = Cluster(serve, "2:3", *conf, last_call=2, backend=Backend("etcd", members))
    cluster.flags = tuple(endpoint if f == cluster.endpoint else f for f in cluster.flags)
    args = ("--until", str(tmp_path / "finish"))
    a = await cluster.first("a", *args)
    b, c = await cluster.node("b", *args), await cluster.node("c", *args)
    n = await ready_together({"a": a, "b": b, "c": c}, "c")

    on_leader = {id(r): "etcd: now talking to" not in r.stderr.text for r in (a, b, c)}
    assert on_leader[id(b)] or on_leader[id(c)], "both survivors left the leader early"
    await members.kill(leader)
    down = rf"etcd member {first.url} does not answer"
    for run in (a, b, c):
        if on_leader[id(run)]:
            await run.stderr.expect(down)
    for run, rank in ((a, 0), (b, 1), (c, 2)):  # training goes on, in the same attempt
        await run.stdout.expect(rf"step a{n} r{rank}", start=len(run.stdout.lines))

    a_ranks = ranks_of(a, "a")
    a.signal(signal.SIGKILL)
    await b.stdout.expect(rf"ready a{n + 1} r0")
    await c.stdout.expect(rf"ready a{n + 1} r1")
    assert await wait_pids_gone(a_ranks, timeout=10) == []

    await members.restart(leader)
    for run in (b, c):
        if on_leader[id(run)]:
            await run.stderr.expect(rf"etcd member {first.url} answers again")

    d = await cluster.node("d", *args)
    await d.stdout.expect(rf"ready a{n + 2} r2")
    (tmp_path / "finish").touch()
    for run in (b, c, d):
        assert await run.wait() == 0, run.stderr.text[-4000:]
    assert await a.wait() == -signal.SIGKILL

    wanted = (
        "coordination_endpoint_down",
        "node_lost",
        "round_closed",
        "coordination_endpoint_up",
        "cluster_request",
    )
    reported_lost: list[str] = []
    for run, node in ((b, "b"), (c, "c")):
        seen = kinds(run, node, *wanted)
        steps = [kind for kind, _ in seen if kind != "round_closed" or _["round"] > n]
        noticed = ["coordination_endpoint_down"] if on_leader[id(run)] else []
        back = ["coordination_endpoint_up"] if on_leader[id(run)] else []
        # Node rank 0 died: each survivor watches it, and the first to hear asks the restart;
        # the other may hear that request before its own watch's news (seen beside two CPU
        # hogs), and then has nothing to report: a node lost once at most, by one at least.
        assert [k for k in steps if k != "node_lost"] == [
            *noticed,  # the etcd leader died
            "cluster_request",  # node rank 0 died
            "round_closed",
            *back,  # the etcd member is back
            "cluster_request",  # d joined
            "round_closed",
        ], seen
        closed = [data for kind, data in seen if kind == "round_closed" and data["round"] > n]
        assert [c["members"] for c in closed] == [["b", "c"], ["b", "c", "d"]]
        lost = [data["node_id"] for kind, data in seen if kind == "node_lost"]
        assert lost in (["a"], []), seen
        reported_lost += lost
        requests = [data["reason"] for kind, data in seen if kind == "cluster_request"]
        assert requests[0].startswith("node a lost: no keepalive for 2s"), requests
        assert requests[1] == "node d joined: scaling up from 2 nodes"
    assert reported_lost, "neither survivor reported node rank 0 lost"


async def test_a_killed_daemon_is_declared_dead_within_its_lease_ttl(
    serve: ServeFactory, etcd: ClusterFactory
) -> None:
    a, b, n = await two_nodes_in_a_round(serve, Backend("etcd", await etcd(1)))
    killed_at = time.time()
    b.signal(signal.SIGKILL)
    assert await a.wait(timeout=30) == 0
    [lost] = events_in(run_dir(a, "a"), "node_lost")
    # The lease's TTL is --node-keepalive-timeout (2 s), counted from its last renewal (at
    # most a third of it before the kill); etcd looks for expired leases every 500 ms.
    assert float(lost["time"]) - killed_at < 2 + 1.5, lost  # type: ignore[arg-type]
    assert lost["data"] == {
        "node_id": "b",
        "reason": "node b lost: no keepalive for 2s (its etcd lease expired)",
    }
    assert f"ready a{n + 1} r0" in a.stdout.text


async def test_quorum_lost_training_goes_on_and_resumes_when_it_returns(
    serve: ServeFactory, etcd: ClusterFactory, tmp_path: Path
) -> None:
    """Two of three etcd members die while both nodes train. Node b's rank then fails: b cannot
    end the round without etcd, says so, and waits; node a's rank trains on. When the members
    return, the round ends, the next one forms, and the job finishes."""
    members = await etcd(3)
    cluster = Cluster(
        serve,
        "2",
        "--max-restarts", "1", "--rdzv-conf", "read_timeout=1", "--rdzv-join-timeout", "120",
        backend=Backend("etcd", members),
    )  # fmt: skip
    args = ("--until", str(tmp_path / "finish"))
    a = await cluster.first("a", *args)
    b = await cluster.node("b", *args)
    await ready_together({"a": a, "b": b}, "b")
    dead = [1, 2]  # the daemons talk to member 0: it stays, without a quorum
    for index in dead:
        await members.kill(index)

    (b.out / "fail_a0_r1").touch()
    # Said once, by whichever of b's etcd calls fails first (on a busy machine the lease's
    # keepalive or a status write can come before the restart's count).
    await b.stderr.expect(r"etcd at .+ does not answer \(")
    assert "The running attempt goes on; a new round waits for etcd" in b.stderr.text
    for _ in range(3):  # a's rank keeps training meanwhile
        await a.stdout.expect(r"step a0 r0", start=len(a.stdout.lines))
    assert [e["data"]["round"] for e in events_in(run_dir(a, "a"), "round_closed")] == [0]  # type: ignore[index]

    for index in dead:
        await members.restart(index)
    await b.stderr.expect("answers again after")
    await a.stdout.expect("ready a1 r0")
    await b.stdout.expect("ready a1 r1")
    (tmp_path / "finish").touch()
    assert await a.wait() == 0 and await b.wait() == 0
    seen = [kind for kind, _ in kinds(b, "b", "coordination_unavailable", "coordination_restored")]
    assert seen[:2] == ["coordination_unavailable", "coordination_restored"]
    assert json.loads((run_dir(b, "b") / "status.json").read_text())["restart_count"] == 1


async def test_forged_replayed_and_garbage_values_are_ignored(
    serve: ServeFactory, etcd: ClusterFactory, tmp_path: Path
) -> None:
    """Values planted under the job's prefix by someone without the job's secret: unsigned,
    signed with another secret, signed for another key (replayed), or no record at all. The
    job runs as if they were not there: same result, ranks' addresses, restart budget."""
    members = await etcd(1)
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET)
    secret_file.chmod(0o600)
    mine, unsigned = RecordCodec("job", SECRET), RecordCodec("job", None)
    forger = RecordCodec("job", b"another secret of 32 bytes here!")
    evil = Member(node_id="evil", addr="10.6.6.6", nproc=1, store_port=666)
    fail = RequestRecord(action="fail", reason="forged", by="evil")
    planted = {
        "round": unsigned.encode("round", RoundHint(number=7)),
        "excluded": unsigned.encode("excluded", ExcludedRecord(nodes={"b": "forged"})),
        "r0/closed": "\x00garbage",
        "r0/request": forger.encode("r0/request", fail),
        "r0/join/evil": unsigned.encode("r0/join/evil", evil),
        "r0/respawn/x": "ftd1 - not json",
        "r1/closed": mine.encode(
            "r9/closed", RoundRecord(number=1, members=(RoundMember.of(evil),), restarts=0)
        ),  # replayed from another round
        "r1/request": mine.encode("r0/request", fail),  # replayed from round 0
    }
    async with EtcdClient(members.endpoints, prefix="/ftd/job/") as client:
        for key, value in planted.items():
            await client.put(key, value.encode())
    cluster = Cluster(
        serve, "2", "--max-restarts", "1", "--rdzv-conf", f"secret_file={secret_file}",
        backend=Backend("etcd", members),
    )  # fmt: skip
    args = ("--fail-attempts", "1", "--fail-rank", "1", "--fail-mode", "exit:1", "--dump-env")
    a = await cluster.first("a", *args)
    b = await cluster.node("b", *args)
    assert await a.wait() == 0, a.stderr.text[-4000:]
    assert await b.wait() == 0, b.stderr.text[-4000:]
    logs = a.stderr.text + b.stderr.text
    for key, cause in (
        ("round", "unsigned"),
        ("excluded", "unsigned"),
        ("r0/closed", "malformed"),
        ("r0/request", "bad_signature"),
        ("r0/join/evil", "unsigned"),
        ("r0/respawn/x", "unsigned"),
        ("r1/closed", "bad_signature"),
        ("r1/request", "bad_signature"),
    ):
        assert f"ignored the rendezvous record at {key!r} ({cause})" in logs, key
    for run, node in ((a, "a"), (b, "b")):
        assert json.loads((run_dir(run, node) / "status.json").read_text())["restart_count"] == 1
        closed = [e["data"] for e in events_in(run_dir(run, node), "round_closed")]
        assert [(c["round"], c["members"]) for c in closed] == [(0, ["a", "b"]), (1, ["a", "b"])]  # type: ignore[index]
    env = json.loads((a.out / "env_1.json").read_text())  # attempt 1's rank 1, on b
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert (env["GROUP_RANK"], env["WORLD_SIZE"]) == ("1", "2")


async def test_etcd_operations_per_round_grow_linearly(etcd: ClusterFactory) -> None:
    """A round costs O(N) etcd requests: a constant number per node, whatever N."""
    members = await etcd(1)
    endpoint = members.rdzv_endpoint
    for nodes in (2, 8, 16):
        coordinators = [
            EtcdCoordinator(
                ServeConfig(
                    entrypoint=__file__,
                    nnodes_min=nodes,
                    nnodes_max=nodes,
                    rdzv_backend="etcd",
                    rdzv_endpoint=endpoint,
                    run_id=f"ops{nodes}",
                    node_id=f"n{node:02d}",
                    local_addr="127.0.0.1",
                ),
                SECRET,
                lambda kind, data: None,
            )
            for node in range(nodes)
        ]
        try:
            for coordinator in coordinators:
                await coordinator.start(lambda node, reason: None)
            before = [c.ops for c in coordinators]
            me = [
                Member(node_id=c.node_id, addr="127.0.0.1", nproc=1, store_port=1)
                for c in coordinators
            ]
            joins = (c.join(m) for c, m in zip(coordinators, me, strict=True))
            rounds = await asyncio.gather(*joins)
            ops = [c.ops - b for c, b in zip(coordinators, before, strict=True)]
        finally:
            for coordinator in coordinators:
                await coordinator.close()
        assert sorted(r.group_rank for r in rounds) == list(range(nodes))
        # Each node (9), in etcd requests: read round 0 (four ranges: hint, excluded, closed,
        # request), the join transaction (which moves the hint), watch its assignment and the
        # round's `assigning` mark, watch the closed record (a round this short is read
        # whole, coordination/assignment.py), read the alive keys of those it watches; the
        # closer (9): read the joiners, close, write the assignments.
        assert sum(ops) <= 9 * nodes + 12, ops


def coordinator(
    endpoint: str,
    node_id: str,
    reports: asyncio.Queue[tuple[str, Any]],
    join_timeout_s: float = 600,
    conf: dict[str, str] | None = None,
    nnodes_min: int = 1,
) -> EtcdCoordinator:
    config = ServeConfig(
        rdzv_join_timeout_s=join_timeout_s,
        entrypoint=__file__,
        nnodes_min=nnodes_min,
        nnodes_max=2,
        rdzv_backend="etcd",
        rdzv_endpoint=endpoint,
        rdzv_conf=conf or {},
        run_id="unit",
        node_id=node_id,
        local_addr="127.0.0.1",
        node_keepalive_timeout_s=1,
        rdzv_last_call_timeout_s=0,
    )
    return EtcdCoordinator(config, SECRET, lambda kind, data: reports.put_nowait((kind, data)))


async def test_a_lease_etcd_ended_is_replaced_and_the_others_see_the_node_leave(
    etcd: ClusterFactory,
) -> None:
    members = await etcd(1)
    ignored: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    reports: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    # Two nodes at least: one round with both (a busy machine may otherwise close a's alone).
    a = coordinator(members.rdzv_endpoint, "a", ignored, nnodes_min=2)
    b = coordinator(members.rdzv_endpoint, "b", reports, nnodes_min=2)
    lost: asyncio.Queue[str] = asyncio.Queue()
    try:
        await a.start(lambda node, reason: lost.put_nowait(reason))
        await b.start(lambda node, reason: None)
        me = [Member(node_id=n, addr="127.0.0.1", nproc=1, store_port=1) for n in ("a", "b")]
        rounds = await asyncio.gather(a.join(me[0]), b.join(me[1]))
        assert {tuple(r.node_ids) for r in rounds} == {("a", "b")}, rounds
        assert b._liveness is not None
        old = b._liveness.lease_id
        async with EtcdClient(members.endpoints) as admin:
            await admin.revoke(old)  # what etcd does to a lease it heard nothing from
            reason = await asyncio.wait_for(lost.get(), 10)
            assert reason == "node b lost: no keepalive for 1s (its etcd lease expired)"
            kind, _ = await asyncio.wait_for(reports.get(), 10)
            assert kind == "coordination_lease_replaced"
            alive = await admin.get("/ftd/unit/alive/b")
        assert alive is not None and alive.lease == b._liveness.lease_id != old
        assert not b.lost.is_set()
    finally:
        await a.close()
        await b.close()


def running(node_id: str) -> dict[str, Any]:
    """A node's summary: running, one rank."""
    return {"node_id": node_id, "state": "running", "attempt": 0, "restart_count": 0,
            "group_rank": 0, "nproc_per_node": 1, "time": time.time()}  # fmt: skip


async def test_the_cluster_view_says_why_etcd_is_unknown(etcd: ClusterFactory) -> None:
    members = await etcd(1)
    reports: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    a = coordinator(members.rdzv_endpoint, "a", reports, conf={"read_timeout": "0.5"})
    try:
        await a.start(lambda node, reason: None)
        await a.publish_status(running("a"))
        view = await a.cluster()
        assert view["nodes"][0]["state"] == "running" and "unavailable" not in view
        await members.kill(0)
        view = await a.cluster()
        assert view["nodes"] == [{"node_id": "a", "state": "unknown", "role": "active"}]
        assert "etcd did not answer" in view["unavailable"], view
        seen = {reports.get_nowait()[0] for _ in range(reports.qsize())}
        assert "coordination_unavailable" in seen, seen
    finally:
        await a.close()


async def test_the_cluster_view_decodes_a_summary_once_and_never_keeps_one_replaced(
    etcd: ClusterFactory,
) -> None:
    """The view keeps what each summary's bytes decoded to: the same bytes again are not
    decoded again; different bytes under the key always are (a forgery is refused at every
    read, a record copied under another node's key too), and the first bytes, back, are
    shown again."""
    members = await etcd(1)
    reports: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    a = coordinator(members.rdzv_endpoint, "a", reports)
    decoded: list[str] = []
    decode = a._kv.decode
    a._kv.decode = lambda kv, *args: decoded.append(kv.key.decode()) or decode(kv, *args)  # type: ignore[method-assign]
    try:
        await a.start(lambda node, reason: None)
        await a.publish_status(running("a"))
        shown = [n["state"] for n in (await a.cluster())["nodes"]]
        assert shown == ["running"] and decoded.count("status/a") == 1
        await a.cluster()
        assert decoded.count("status/a") == 1, "the same bytes were decoded again"
        async with EtcdClient(members.endpoints) as admin:
            good = await admin.get("/ftd/unit/status/a")
            assert good is not None
            for forged in (good.value[:-1] + b"x", good.value):
                await admin.put("/ftd/unit/status/a", b"garbage")
                for _ in range(2):
                    view = await a.cluster()
                    assert [n["state"] for n in view["nodes"]] == ["unknown"], view
                await admin.put("/ftd/unit/status/a", forged)
                await admin.put("/ftd/unit/status/b", good.value)  # a's record as b's
                view = await a.cluster()
                assert all(n["node_id"] != "b" for n in view["nodes"]), view
            assert [n["state"] for n in view["nodes"]] == ["running"], view
        assert decoded.count("status/a") == 7
        assert sum(a.codec.refused.values()) >= 7, a.codec.refused
    finally:
        await a.close()


async def test_tls_and_an_etcd_user(etcd: ClusterFactory, tmp_path: Path) -> None:
    members = await etcd(1, tls=True)
    assert members.tls is not None
    await members.enable_auth("s3cret")
    password = tmp_path / "password"
    password.write_text("s3cret\n")
    password.chmod(0o600)
    conf = {
        "cacert": str(members.tls.ca),
        "cert": str(members.tls.client_cert),
        "key": str(members.tls.client_key),
        "username": "root",
        "password_file": str(password),
    }
    reports: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    a = coordinator(members.rdzv_endpoint, "a", reports, conf=conf)
    assert a.conf.endpoints[0].startswith("https://")
    try:
        await a.start(lambda node, reason: None)
        rnd = await a.join(Member(node_id="a", addr="127.0.0.1", nproc=1, store_port=1))
        assert rnd.node_ids == ("a",)
    finally:
        await a.close()
    password.write_text("wrong\n")
    b = coordinator(members.rdzv_endpoint, "b", reports, conf=conf)
    try:
        with pytest.raises(CoordinationError, match="etcd refused ftd's credentials"):
            await b.start(lambda node, reason: None)
    finally:
        await b.close()


async def test_an_endpoint_that_is_not_etcd_fails_the_start_at_once() -> None:
    from aiohttp import web

    async def refuse(request: web.Request) -> web.Response:
        return web.Response(status=404, text="no")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    reports: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    a = coordinator(f"127.0.0.1:{port}", "a", reports)
    try:
        with pytest.raises(CoordinationError, match="--rdzv-endpoint: not etcd's answer"):
            await asyncio.wait_for(a.start(lambda node, reason: None), 30)
    finally:
        await a.close()
        await runner.cleanup()


async def test_a_round_end_waits_for_etcd_no_longer_than_the_join_timeout(
    etcd: ClusterFactory,
) -> None:
    members = await etcd(1)
    reports: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    a = coordinator(
        members.rdzv_endpoint, "a", reports, join_timeout_s=2, conf={"read_timeout": "0.5"}
    )
    try:
        await a.start(lambda node, reason: None)
        rnd = await a.join(Member(node_id="a", addr="127.0.0.1", nproc=1, store_port=1))
        await members.kill(0)
        started = time.monotonic()
        with pytest.raises(CoordinationError) as error:
            await a.request(rnd, new_request("restart", "a rank failed", "a"))
        assert error.value.code == "store_lost"
        assert "etcd did not answer within --rdzv-join-timeout" in error.value.reason
        assert 2 <= time.monotonic() - started < 2 + 3
        assert not a.lost.is_set()  # the node's lease is not known to be gone
    finally:
        await a.close()


def etcd_config(tmp_path: Path, **conf: str) -> ServeConfig:
    return ServeConfig(
        entrypoint=__file__,
        nnodes_min=2,
        nnodes_max=2,
        rdzv_backend="etcd",
        rdzv_endpoint="127.0.0.1:2379,[::1]:2380",
        rdzv_conf=conf,
        run_id="job",
        node_keepalive_timeout_s=2.5,
    )


def test_etcd_conf_is_parsed_with_bounds(tmp_path: Path) -> None:
    password = tmp_path / "pw"
    password.write_text("s3cret\n")
    password.chmod(0o600)
    conf = parse_etcd_conf(
        etcd_config(tmp_path, prefix="/team-a/", username="ftd", password_file=str(password))
    )
    assert conf.endpoints == ("http://127.0.0.1:2379", "http://[::1]:2380")
    assert conf.root == "/team-a/ftd/job/" and conf.lease_ttl_s == 3  # ceil(2.5)
    assert (conf.username, conf.password) == ("ftd", "s3cret")
    password.chmod(0o644)
    for bad, message in (
        ({"password_file": str(password), "username": "ftd"}, "readable by others"),
        ({"username": "ftd"}, "give both"),
        ({"lease_ttl": "0"}, "lease_ttl=0: a whole number of seconds"),
        ({"lease_ttl": "2.5"}, "a whole number of seconds"),
        ({"read_timeout": "nan"}, "read_timeout=nan"),
        ({"prefix": "a b"}, "prefix='a b'"),
        ({"is_host": "1"}, "is_host: not an option of the etcd backend"),
        ({"cacert": str(tmp_path / "none.pem")}, "not a readable file"),
        ({"protocol": "gopher"}, "expected http or https"),
    ):
        with pytest.raises(CoordinationError, match=message.replace("(", r"\(")):
            parse_etcd_conf(etcd_config(tmp_path, **bad))


def test_a_bad_etcd_conf_is_a_one_line_usage_error(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable, "-m", "ftd", "serve", "--nnodes", "2", "--rdzv-backend", "etcd",
            "--rdzv-endpoint", "127.0.0.1:2379", "--rdzv-conf", "lease_ttl=forever",
            "--log-dir", str(tmp_path), "--api-port", "0", str(WORKER),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "ftd serve: error: --rdzv-conf lease_ttl=forever: a whole number of seconds in [1, 3600]"
    )


def test_serve_help_lists_the_backends_and_their_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from ftd.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--rdzv-backend NAME c10d (alias static:" in text
    assert "etcd (alias etcd-v3:" in text
    assert "etcd: the members, host:port,host:port,..." in text
    assert "password_file (a 0600 file), prefix, lease_ttl" in text
