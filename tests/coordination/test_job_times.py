"""The job's times without N² reads (issue 43 item 3): node rank 0 reads every node's summary and
writes the job's times once; every other node reads that one record. Real coordinators on a
real TCPStore and a real etcd, their own operation counts."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from ftd.config.serve import ServeConfig
from ftd.coordination import Coordinator
from ftd.coordination.job_share import JobShare
from ftd.coordination.records import MAX_PUBLISHED_RANKS, JobTimes, Member
from ftd.health.job_times import JobTimesShare, job_record, node_times, sampled
from ftd.health.stragglers import compare
from tests.conftest import free_port
from tests.support.etcd_cluster import ClusterFactory

SECRET = b"a job secret of thirty-two bytes!"


def summary(
    node_id: str, ranks: range, forward_ms: float, replicated: tuple[int, ...] = (), rnd: int = 0
) -> dict[str, Any]:
    forward = tuple(
        {"global_rank": r, "forward_us": round(forward_ms * 1000) + r, "host_us": 5000}
        for r in ranks
    )
    return {
        "node_id": node_id,
        "state": "running",
        "attempt": 0,
        "restart_count": 0,
        "group_rank": None,
        "nproc_per_node": len(ranks),
        "time": 1.0,
        "forward": forward,
        "replicated_steps": replicated,
        "replicated_round": rnd,
    }


def test_the_record_keeps_every_rank_of_a_small_job_and_the_median_of_a_large_one() -> None:
    small = {"forward": {r: 0.01 * (r + 1) for r in range(8)}, "host": {3: 0.002}}
    record = JobTimes.model_validate(job_record(4, 1.0, small))
    assert [row[0] for row in record.forward] == list(range(8))
    assert record.forward[3] == (3, 40000, 2000) and record.round == 4
    rng = random.Random(7)
    big = {r: rng.lognormvariate(-3, 0.3) for r in range(20_000)}
    times = {"forward": big, "host": {}}
    kept = sampled(times)
    assert len(kept) == MAX_PUBLISHED_RANKS and max(big, key=big.__getitem__) in kept
    JobTimes.model_validate(job_record(0, 1.0, times))  # within the record's bounds
    seen = compare(-1, {**{r: big[r] for r in kept}, -1: 1.0})
    truth = compare(-1, {**big, -1: 1.0})
    assert seen is not None and truth is not None
    assert abs(seen.median_s - truth.median_s) / truth.median_s < 0.02


def c10d_coordinators(port: int, nodes: int) -> list[Coordinator]:
    from ftd.coordination.c10d.coordinator import StoreCoordinator

    def config(node: int) -> ServeConfig:
        return ServeConfig(
            entrypoint=__file__,
            nnodes_min=nodes,
            nnodes_max=nodes,
            rdzv_endpoint=f"127.0.0.1:{port}",
            run_id=f"times{nodes}",
            node_id=f"n{node:02d}",
            local_addr="127.0.0.1",
        )

    return [StoreCoordinator(config(node), secret=SECRET) for node in range(nodes)]


def etcd_coordinators(endpoint: str, nodes: int, run_id: str) -> list[Coordinator]:
    from ftd.coordination.etcd.coordinator import EtcdCoordinator

    def config(node: int) -> ServeConfig:
        return ServeConfig(
            entrypoint=__file__,
            nnodes_min=nodes,
            nnodes_max=nodes,
            rdzv_backend="etcd",
            rdzv_endpoint=endpoint,
            run_id=run_id,
            node_id=f"n{node:02d}",
            local_addr="127.0.0.1",
        )

    return [EtcdCoordinator(config(node), SECRET, lambda k, d: None) for node in range(nodes)]


async def looks_cost(coordinators: Sequence[Any], nproc: int = 8) -> tuple[list[int], list[Any]]:
    """Every node joins a round and publishes its summary; then each looks at the job's times
    once (node rank 0 first): the operations each look cost, and what each saw."""
    order = await joined(coordinators, nproc)
    costs, seen = [], []
    for coordinator in order:
        share = JobTimesShare(JobShare(coordinator, lambda: True))
        before = coordinator.ops
        seen.append(await share.read(2.0))
        costs.append(coordinator.ops - before)
    return costs, seen


async def joined(coordinators: Sequence[Any], nproc: int = 8) -> list[Any]:
    """Every node joins a round and publishes its summary (node rank r: forward 10 ms but rank
    1's 60, replicated steps r and r + 1); the coordinators by node rank."""
    for coordinator in coordinators:
        await coordinator.start(lambda node, reason: None)
    me = [
        Member(node_id=c.node_id, addr="127.0.0.1", nproc=nproc, store_port=1) for c in coordinators
    ]
    rounds = await asyncio.gather(*(c.join(m) for c, m in zip(coordinators, me, strict=True)))
    for coordinator, rnd in zip(coordinators, rounds, strict=True):
        first, r = rnd.group_rank * nproc, rnd.group_rank
        await coordinator.publish_status(
            summary(
                coordinator.node_id, range(first, first + nproc), 10 + 50 * (r == 1), (r, r + 1)
            )
        )
    return [c for _, c in sorted(zip((r.group_rank for r in rounds), coordinators, strict=True))]


@pytest.mark.parametrize("nodes", [4, 16])
async def test_c10d_a_look_costs_node_rank_0_one_read_of_all_and_the_others_one_get(
    nodes: int,
) -> None:
    from ftd_client.store import tcp_store_server

    port = free_port()
    server = tcp_store_server("127.0.0.1", port)
    coordinators = c10d_coordinators(port, nodes)
    try:
        costs, seen = await looks_cost(coordinators)
    finally:
        for coordinator in coordinators:
            await coordinator.close()
        del server
    # Node rank 0: the cluster view (the round's and the excluded records, the members'
    # summaries in one multi_get) and the record; every other node: the record (check, get).
    assert costs[0] <= 6 and max(costs[1:]) <= 2, costs  # the same whatever N
    assert all(s == seen[0] for s in seen), "every node judges against the same times"
    assert seen[0] is not None and len(seen[0]["forward"]) == 8 * nodes
    assert seen[0]["forward"][8] == pytest.approx(0.060008)  # node rank 1's first rank
    assert node_times({"nodes": [summary("x", range(2), 1.0)]}, "x") == {"forward": {}, "host": {}}


async def test_etcd_a_look_costs_node_rank_0_one_range_and_the_others_one_get(
    etcd: ClusterFactory,
) -> None:
    endpoint = (await etcd(1)).rdzv_endpoint
    for nodes in (2, 8):
        coordinators = etcd_coordinators(endpoint, nodes, f"times{nodes}")
        try:
            costs, seen = await looks_cost(coordinators)
        finally:
            for coordinator in coordinators:
                await coordinator.close()
        # Node rank 0: the cluster view's ranges and the record; the others: one range.
        assert costs[0] <= 5 and max(costs[1:]) <= 1, (nodes, costs)
        assert all(s == seen[0] for s in seen) and len(seen[0]["forward"]) == 8 * nodes


@pytest.mark.parametrize("nodes", [4, 16])
async def test_c10d_a_replica_look_costs_a_node_its_successor_and_the_floor_whatever_n(
    nodes: int, tmp_path: Path
) -> None:
    """The replicas' ring: node rank 0 reads every summary and writes the floor; every other
    node reads its successor's summary and the floor, and keeps what the others' replicas need
    (node rank r replicated steps r and r + 1: the floor is 0, node rank 0's is 1)."""
    from ftd_client.store import tcp_store_server

    from ftd.checkpoint.holder import CheckpointHolder
    from ftd.checkpoint.replication import Replication
    from ftd.status.events import EventLog

    port = free_port()
    server = tcp_store_server("127.0.0.1", port)
    coordinators = c10d_coordinators(port, nodes)
    try:
        order = await joined(coordinators)
        costs, holders = [], []
        for coordinator in order:
            rnd = coordinator.round
            view = (
                rnd.number,
                rnd.node_ids,
                range(8 * rnd.group_rank, 8 * rnd.group_rank + 8),
                8 * nodes,
            )
            holder = CheckpointHolder(
                tmp_path / coordinator.node_id, 1 << 20, EventLog(None), True, base=tmp_path
            )
            replication = Replication(
                SECRET, coordinator.node_id, EventLog(None), lambda v=view: v,
                JobShare(coordinator, lambda: True), lambda: None, holder,
            )  # fmt: skip
            before = coordinator.ops
            await replication._watch()
            costs.append(coordinator.ops - before)
            holders.append(holder)
            assert replication.ring.addresses == {}  # nobody published a replica server here
    finally:
        for coordinator in coordinators:
            await coordinator.close()
        del server
    # Node rank 0: the cluster view and the floor; the others: the successor's summary and the
    # floor (a check and a get each).
    assert costs[0] <= 6 and max(costs[1:]) <= 4, costs
    assert [h.ledger.keep_from for h in holders] == [1] + [0] * (nodes - 1)
    assert all(h.ledger.pinned for h in holders)
