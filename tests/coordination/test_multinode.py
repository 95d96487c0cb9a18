"""Multi-node: several `ftd serve` daemons on 127.0.0.1 meeting through one backend.

Tests that take the `backend` fixture run twice: through a c10d TCPStore and through a real
etcd member (tests/support/etcd_cluster.py). The others are specific to the TCPStore backend (the
store's host, `ftd store`, its operation count) and say so.
tests/coordination/etcd/test_etcd_coordinator.py has what only etcd does (its members failing,
quorum, leases).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import (
    ROOT,
    Backend,
    ServeFactory,
    events_in,
    free_port,
    pids_with_env,
    wait_pids_gone,
)
from tests.support.cluster import (
    Cluster,
    api,
    ranks_of,
    ready_together,
    run_dir,
    two_nodes_in_a_round,
)

pytestmark = pytest.mark.timeout(90)

EXIT_1 = ("--fail-mode", "exit:1")
"""How a rank crashes here: an exit, not a raise, whose error file a forked rank would import
torch to write (seconds of CPU per crash); what an error file holds is test_zygote.py's."""


async def test_rank_crash_on_one_node_restarts_every_node(
    serve: ServeFactory, backend: Backend
) -> None:
    cluster = Cluster(serve, "2", "--max-restarts", "1", backend=backend)
    # A raise, not EXIT_1: b's rank must not fail before a's rank 0 is up (seen on a clean
    # clone: the instant exit ended the round before a's rank marked itself ready).
    args = ("--hang-attempts", "1", "--fail-attempts", "1", "--fail-rank", "1")
    a = await cluster.first("a", *args)
    b = await cluster.node("b", *args)
    assert await a.wait() == 0 and await b.wait() == 0
    # a's rank 0 hung in attempt 0: only the cluster-wide restart stopped it.
    assert (a.out / "ready_a0_r0").exists() and (a.out / "ready_a1_r0").exists()
    assert "round 0 ended by b: rank 1 (local 0" in a.stderr.text
    [failed] = events_in(run_dir(b, "b"), "attempt_failed")
    [woken] = events_in(run_dir(a, "a"), "cluster_request")
    latency = float(woken["time"]) - float(failed["time"])  # type: ignore[arg-type]
    assert latency < 0.5, latency  # 100 ms on an idle machine; this one is shared
    assert {
        e["data"]["members"] == ["a", "b"] for e in events_in(run_dir(a, "a"), "round_closed")
    } == {True}  # type: ignore[index]


async def test_sigkill_of_a_node_the_others_go_on(serve: ServeFactory, backend: Backend) -> None:
    a, b, n = await two_nodes_in_a_round(serve, backend)
    b_ranks = ranks_of(b, "b")
    b.signal(signal.SIGKILL)
    assert await a.wait(timeout=30) == 0
    assert "node b lost: no keepalive for" in a.stderr.text
    assert f"ready a{n + 1} r0" in a.stdout.text  # the next round: a alone, the job finished
    assert await wait_pids_gone(b_ranks, timeout=10) == []


async def test_sigkill_of_the_store_host_stops_everyone(serve: ServeFactory) -> None:
    """c10d only: the daemon that hosts the TCPStore takes it along (under etcd, no daemon
    hosts anything: test_etcd_coordinator.py kills node rank 0 and the job goes on)."""
    cluster = Cluster(serve, "2")
    a = await cluster.first("a", "--hang")
    b = await cluster.node("b", "--hang")
    await b.stdout.expect("ready a0 r1")
    b_ranks = ranks_of(b, "b")
    started = time.monotonic()
    a.signal(signal.SIGKILL)
    assert await b.wait(timeout=20) == 1
    assert time.monotonic() - started < 2 + 2 + 1  # keepalive, the ranks' stop grace
    assert "store lost: the rendezvous store at" in b.stderr.text
    assert await wait_pids_gone(b_ranks, timeout=5) == []
    assert pids_with_env("FTD_RUN_DIR", str(run_dir(b, "b"))) == []
    assert json.loads((run_dir(b, "b") / "status.json").read_text())["state"] == "failed"


async def test_late_node_scales_the_job_up(serve: ServeFactory, backend: Backend) -> None:
    cluster = Cluster(serve, "1:2", last_call=0.3, backend=backend)
    a = await cluster.node("a", "--hang-attempts", "1", "--dump-env")
    await a.stdout.expect("ready a0 r0")
    b = await cluster.node("b", "--hang-attempts", "1", "--dump-env")
    assert await a.wait() == 0, a.stderr.text[-4000:]
    assert await b.wait() == 0, b.stderr.text[-4000:]
    assert "node b joined: scaling up from 1 nodes" in a.stderr.text
    env = json.loads((a.out / "env_1.json").read_text())  # attempt 1's rank 1, on b
    assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"], env["WORLD_SIZE"]) == ("1", "2", "2")
    assert env["FTD_NODE_ID"] == "b" and env["TORCHELASTIC_RESTART_COUNT"] == "1"


async def test_a_node_waiting_for_the_others_says_who_is_there(
    serve: ServeFactory, backend: Backend
) -> None:
    cluster = Cluster(serve, "2", backend=backend)
    a = await cluster.first("a")
    await a.stderr.expect(r"round 0: waiting for nodes: 1 joined \(a\), 2 to 2 wanted; the join")
    b = await cluster.node("b")
    assert await a.wait() == 0, a.stderr.text[-4000:]
    assert await b.wait() == 0, b.stderr.text[-4000:]


async def test_excluded_node_stops_and_is_refused(serve: ServeFactory, backend: Backend) -> None:
    cluster = Cluster(serve, "1:2", backend=backend)
    a = await cluster.first("a", "--hang")
    b = await cluster.node("b", "--hang")
    n = await ready_together(a, b)
    code, body = await api(a, "a", "POST", "/v1/nodes/b/exclude")
    assert code == 202, body
    assert await b.wait(timeout=30) == 1
    assert "node b is excluded from job job (node b excluded by" in b.stderr.text
    await a.stdout.expect(f"ready a{n + 1} r0")  # a goes on alone
    code, view = await api(a, "a", "GET", "/v1/cluster")
    assert code == 200 and view["round"] == {"round": n + 1, "members": ["a"], "size": 1}
    assert [e["node_id"] for e in view["excluded"]] == ["b"]  # type: ignore[attr-defined, index]
    excluded = json.loads((run_dir(b, "b") / "cluster.json").read_text())["excluded"]
    assert list(excluded) == ["b"]
    again = await cluster.node("b", "--hang")
    assert await again.wait(timeout=30) == 1
    assert "node b is excluded from job job" in again.stderr.text
    a.signal(signal.SIGTERM)
    assert await a.wait() == 128 + signal.SIGTERM


async def test_max_restarts_are_counted_cluster_wide(serve: ServeFactory, backend: Backend) -> None:
    cluster = Cluster(serve, "2", "--max-restarts", "2", backend=backend)
    args = ("--fail-attempts", "99", "--fail-rank", "rotate", *EXIT_1)
    a = await cluster.first("a", *args)
    b = await cluster.node("b", *args)
    assert await a.wait() == 1 and await b.wait() == 1
    for run, node in ((a, "a"), (b, "b")):
        status = json.loads((run_dir(run, node) / "status.json").read_text())
        assert status["state"] == "failed" and status["restart_count"] == 2, status
        assert "no restarts left (2/2 used)" in run.stderr.text
    rounds = [e["data"]["round"] for e in events_in(run_dir(a, "a"), "round_closed")]  # type: ignore[index]
    assert rounds == [0, 1, 2]


async def test_two_jobs_on_one_store_do_not_meet(serve: ServeFactory, tmp_path: Path) -> None:
    """c10d only: jobs on one `ftd store` (under etcd, each job's keys have their own prefix:
    test_etcd_coordinator.py)."""
    port = free_port()
    store = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ftd", "store", "--host", "127.0.0.1", "--port", str(port),
        cwd=str(ROOT), stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert store.stderr is not None
        await asyncio.wait_for(store.stderr.readline(), 30)  # listening
        runs = []
        for job in ("j1", "j2"):
            cluster = Cluster(serve, "1:2", "--rdzv-conf", "is_host=0", job=job, last_call=0.3)
            cluster.flags = tuple(
                f"127.0.0.1:{port}" if f == cluster.endpoint else f for f in cluster.flags
            )
            out = str(tmp_path / job)
            runs.append(await cluster.node("x", "--dump-env", "--sleep", "1", "--out", out))
        for run in runs:
            assert await run.wait() == 0
        envs = [json.loads((tmp_path / job / "env_0.json").read_text()) for job in ("j1", "j2")]
        assert {env["TORCHELASTIC_RUN_ID"] for env in envs} == {"j1", "j2"}
        assert {env["GROUP_WORLD_SIZE"] for env in envs} == {"1"}
        assert all("hosting the rendezvous store" not in run.stderr.text for run in runs)
    finally:
        store.send_signal(signal.SIGTERM)
        await asyncio.wait_for(store.wait(), 10)


async def test_frozen_node_is_declared_dead_and_leaves_when_it_wakes(
    serve: ServeFactory, backend: Backend
) -> None:
    """A node that goes silent with its connections open (SIGSTOP: what the others see of a
    partitioned node, short of network namespaces) is dropped like a dead one; when it wakes
    after the job has moved on, it stops its ranks and leaves."""
    a, b, n = await two_nodes_in_a_round(serve, backend)
    b_ranks = ranks_of(b, "b")
    b.signal(signal.SIGSTOP)
    try:
        assert await a.wait(timeout=30) == 0
    finally:
        b.signal(signal.SIGCONT)
    assert "node b lost: no keepalive for" in a.stderr.text
    assert f"ready a{n + 1} r0" in a.stdout.text  # the next round: a alone, it finished
    if backend.etcd is None:  # the store left with its host, a: b has lost it
        assert await b.wait(timeout=30) != 0
        assert json.loads((run_dir(b, "b") / "status.json").read_text())["state"] == "failed"
    else:  # etcd is still there: b takes a new lease, and finds the job over
        await b.wait(timeout=30)
        assert "the job is over: every node's ranks exited 0" in b.stderr.text
    assert await wait_pids_gone(b_ranks, timeout=10) == []


async def test_last_joiner_waits_for_a_counted_join_record_not_written_yet() -> None:
    """c10d only (etcd writes the counter and the record in one transaction). The MAX-th
    joiner closes at once; an earlier joiner may have taken its place in the counter and not
    written its record yet. The closer waits for it: the round closes with both, not with one
    short of MIN (which left both waiting for the join timeout, seen once in CI)."""
    from ftd_client.store import tcp_store_server

    from ftd.config.serve import ServeConfig
    from ftd.coordination.c10d.coordinator import StoreCoordinator
    from ftd.coordination.c10d.record_store import RecordStore
    from ftd.coordination.records import Member, RecordCodec

    port = free_port()
    server = tcp_store_server("127.0.0.1", port)
    secret = b"s" * 32
    config = ServeConfig(
        entrypoint=__file__,
        nnodes_min=2,
        nnodes_max=2,
        rdzv_endpoint=f"127.0.0.1:{port}",
        run_id="late-record",
        node_id="second",
        local_addr="127.0.0.1",
    )
    codec = RecordCodec("late-record", secret)
    first = RecordStore("127.0.0.1", port, "ftd/late-record/", codec, 10)
    coordinator = StoreCoordinator(config, secret=secret)
    waiting = threading.Event()
    handler = logging.Handler()
    handler.emit = lambda record: "not written yet" in record.getMessage() and waiting.set()  # type: ignore[assignment,method-assign]
    logger = logging.getLogger("ftd.rendezvous")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        await coordinator.start(lambda node, reason: None)
        assert first.add("r0/joined", 1) == 1  # the first joiner, between its count and write
        second = Member(node_id="second", addr="127.0.0.1", nproc=1, store_port=1)
        joining = asyncio.ensure_future(coordinator.join(second))
        assert await asyncio.to_thread(waiting.wait, 30), "the closer did not wait"
        first.put("r0/node/1", Member(node_id="first", addr="127.0.0.1", nproc=1, store_port=1))
        rnd = await asyncio.wait_for(joining, 30)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        await coordinator.close()
        first.close()
        del server
    assert (rnd.number, rnd.node_ids, rnd.group_rank) == (0, ("first", "second"), 1)


async def test_a_node_whose_join_meets_the_close_is_late_and_scales_the_round_up() -> None:
    """c10d. A node that joined round 0 in the moment it closed without it (seen on a busy
    machine) is late for it, as one that found it closed: it asks the round to scale up, and
    both nodes meet in round 1. It used to open round 1 on its own and close it alone after the
    last call: two jobs of one node each, on one store."""
    from ftd_client.store import tcp_store_server

    from ftd.config.serve import ServeConfig
    from ftd.coordination.c10d.coordinator import StoreCoordinator
    from ftd.coordination.records import Member

    port = free_port()
    server = tcp_store_server("127.0.0.1", port)

    def node(name: str, last_call_s: float) -> StoreCoordinator:
        config = ServeConfig(
            entrypoint=__file__,
            nnodes_min=1,
            nnodes_max=2,
            rdzv_endpoint=f"127.0.0.1:{port}",
            rdzv_last_call_timeout_s=last_call_s,
            run_id="late-join",
            node_id=name,
            local_addr="127.0.0.1",
        )
        return StoreCoordinator(config, secret=b"s" * 32)

    a, b = node("a", 0.05), node("b", 60)  # b's round 1 closes when a joins it, not alone
    ma, mb = (Member(node_id=n, addr="127.0.0.1", nproc=1, store_port=1) for n in "ab")
    try:
        for coordinator in (a, b):
            await coordinator.start(lambda node, reason: None)
        first = await asyncio.wait_for(a.join(ma), 30)
        assert first.node_ids == ("a",)
        enter = b._rounds.enter
        raced = iter([(0, 2)])  # b's join counted in round 0 after a closed it
        b._rounds.enter = lambda s, me: next(raced, None) or enter(s, me)  # type: ignore[method-assign]
        joining = asyncio.ensure_future(b.join(mb))
        request = await asyncio.wait_for(a.ended(first), 20)
        assert request.action == "restart" and "b joined: scaling up" in request.reason, request
        rounds = [await asyncio.wait_for(a.join(ma), 20), await asyncio.wait_for(joining, 20)]
    finally:
        for coordinator in (a, b):
            await coordinator.close()
        del server
    assert [(r.number, r.node_ids) for r in rounds] == [(1, ("a", "b"))] * 2


async def test_a_store_wait_that_never_wakes_costs_seconds_not_the_job(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """c10d only. A wait blocked in the store whose wake-up never comes (one stalled join was
    seen on a very busy machine) is backed by a look at the key on the operations connection:
    the node goes on, and says so."""
    from ftd_client.store import tcp_store_server

    from ftd.config.serve import ServeConfig
    from ftd.coordination.c10d.coordinator import StoreCoordinator
    from ftd.coordination.records import Member

    port = free_port()
    server = tcp_store_server("127.0.0.1", port)
    config = ServeConfig(
        entrypoint=__file__,
        nnodes_min=1,
        nnodes_max=2,
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_last_call_timeout_s=0.1,
        run_id="deaf",
        node_id="a",
        local_addr="127.0.0.1",
    )
    coordinator = StoreCoordinator(config, secret=b"s" * 32)
    never = threading.Event()
    from ftd.coordination.c10d import round_steps

    monkeypatch.setattr(round_steps, "await_assigned", lambda s, number, me: never.wait())
    caplog.set_level(logging.WARNING, "ftd.rendezvous")
    try:
        await coordinator.start(lambda node, reason: None)
        me = Member(node_id="a", addr="127.0.0.1", nproc=1, store_port=1)
        rnd = await asyncio.wait_for(coordinator.join(me), 60)
    finally:
        never.set()
        await coordinator.close()
        del server
    assert (rnd.number, rnd.node_ids) == (0, ("a",))
    said = "round 0: its closing record was in the store"
    assert said in caplog.text and "store wait had not returned it" in caplog.text


@pytest.mark.parametrize("nodes", [2, 4, 8, 16])
async def test_store_operations_per_round_grow_linearly(nodes: int) -> None:
    """c10d only (etcd's count: test_etcd_coordinator.py). A round costs O(N) operations: a
    constant number per node, whatever N."""
    from ftd_client.store import tcp_store_server

    from ftd.config.serve import ServeConfig
    from ftd.coordination.c10d.coordinator import StoreCoordinator
    from ftd.coordination.records import Member

    port = free_port()
    server = tcp_store_server("127.0.0.1", port)
    coordinators = [
        StoreCoordinator(
            ServeConfig(
                entrypoint=__file__,
                nnodes_min=nodes,
                nnodes_max=nodes,
                rdzv_endpoint=f"127.0.0.1:{port}",
                run_id="ops",
                node_id=f"n{node:02d}",
                local_addr="127.0.0.1",
            ),
            secret=b"s" * 32,
        )
        for node in range(nodes)
    ]
    try:
        for coordinator in coordinators:
            await coordinator.start(lambda node, reason: None)
        before = [c.ops for c in coordinators]
        me = [
            Member(node_id=c.node_id, addr="127.0.0.1", nproc=1, store_port=1) for c in coordinators
        ]
        rounds = await asyncio.gather(*(c.join(m) for c, m in zip(coordinators, me, strict=True)))
        ops = [c.ops - b for c, b in zip(coordinators, before, strict=True)]
    finally:
        for coordinator in coordinators:
            await coordinator.close()
        del server
    assert sorted(r.group_rank for r in rounds) == list(range(nodes))
    assert {r.number for r in rounds} == {0}
    # Each node (11): the round hint (check, get), its exclusion, the round's request and
    # closed record (a check each), the join counter and record, the closed record's wait,
    # its assignment (wait, get), the closed record (get: a round this short is read whole,
    # coordination/assignment.py); the closer (7): the closed check, the counter, every join
    # record (check, multi_get), the excluded nodes, the decision, the assignments; a
    # keepalive may interleave; and, if the closer came between a joiner's count and its
    # write, a wait for that record.
    assert sum(ops) <= 12 * nodes + 10, ops
