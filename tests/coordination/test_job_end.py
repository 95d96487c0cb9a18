"""A job's end without N² reads (issue 43 item 3): each node marks itself succeeded and reads
counts; only a node whose counts say every member may be done reads the members' marks. Nodes
marking a lost node unhealthy read a count too (c10d). Real coordinators on a real TCPStore
and a real etcd."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from ftd.coordination.shared_rounds import key
from tests.conftest import free_port
from tests.coordination.test_job_times import c10d_coordinators, etcd_coordinators, joined
from tests.support.etcd_cluster import ClusterFactory


@pytest.fixture
def full_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The reads of every member's marks, by kind, whichever node made them."""
    from ftd.coordination.c10d.rounds import StoreRounds
    from ftd.coordination.etcd.marks import EtcdMarks

    seen: list[str] = []
    c10d_marks, etcd_marks = StoreRounds.marks, EtcdMarks.marks_now

    def marks(self: StoreRounds, s: Any, number: int, members: list[str], kind: str) -> Any:
        seen.append(kind)
        return c10d_marks(self, s, number, members, kind)

    async def marks_now(self: EtcdMarks, rnd: Any, members: Any, *kinds: str) -> Any:
        seen.extend(kinds)
        return await etcd_marks(self, rnd, members, *kinds)

    monkeypatch.setattr(StoreRounds, "marks", marks)
    monkeypatch.setattr(EtcdMarks, "marks_now", marks_now)
    yield seen


@contextlib.asynccontextmanager
async def c10d_job(nodes: int) -> AsyncIterator[list[Any]]:
    """`nodes` c10d coordinators on a real TCPStore, joined: by node rank."""
    from ftd_client.store import tcp_store_server

    port = free_port()
    server = tcp_store_server("127.0.0.1", port)
    coordinators = c10d_coordinators(port, nodes)
    try:
        yield await joined(coordinators)
    finally:
        for coordinator in coordinators:
            await coordinator.close()
        del server


async def end_of_job(order: list[Any], full_reads: list[str]) -> list[int]:
    """Node rank 0 is lost (every other node marks it unhealthy at once), then each other node
    succeeds in turn: the healthy counts each was told; the reads of all marks are checked
    before the last node's success, and the round must end `succeed`."""
    rnds = [c.round for c in order]
    ended = order[1].ended(rnds[1])
    healthy = await asyncio.gather(
        *(c.unhealthy(rnd, order[0].node_id) for c, rnd in zip(order[1:], rnds[1:], strict=True))
    )
    for coordinator, rnd in zip(order[1:-1], rnds[1:-1], strict=True):
        await coordinator.succeeded(rnd)
    assert not ended.done() and full_reads == [], "only the last node reads the marks"
    await order[-1].succeeded(rnds[-1])
    request = await asyncio.wait_for(ended, 30)
    assert request.action == "succeed" and request.by == order[-1].node_id
    assert await order[1].unhealthy(rnds[1], order[0].node_id) == len(order) - 1  # counted once
    return list(healthy)


@pytest.mark.parametrize("nodes", [4, 16])
async def test_c10d_a_node_reads_counts_at_the_jobs_end_and_the_last_reads_the_marks(
    nodes: int, full_reads: list[str]
) -> None:
    async with c10d_job(nodes) as order:
        healthy = await end_of_job(order, full_reads)
    # N - 1 nodes marked the same node: one mark, counted once (its maker's answer has it;
    # the others' may have come before its count did).
    assert min(healthy) == nodes - 1 and max(healthy) <= nodes
    assert sorted(full_reads) == ["succeeded", "unhealthy"]


async def test_c10d_forged_counts_and_marks_neither_end_the_job_early_nor_hold_it() -> None:
    """A count overwritten with junk is repaired from the marks; a junk mark is overwritten
    by the node's own; a count forged too high only makes the last nodes read the marks."""
    async with c10d_job(4) as order:
        rnd = order[0].round
        n = rnd.number

        def forge(s: Any) -> None:
            s.set(key(n, "unhealthy-count"), "junk")
            s.set(key(n, f"succeeded/{order[2].node_id}"), "junk")
            s.set(key(n, "succeeded-count"), "2")  # as if two nodes were done

        await order[0]._connections.call(forge)
        ended = order[0].ended(rnd)
        for coordinator in order[:3]:
            await coordinator.succeeded(coordinator.round)
        assert not ended.done()  # the forged count made a node read the marks: 3 of 4
        assert await order[3].unhealthy(order[3].round, order[3].node_id) == 3
        await order[3].succeeded(order[3].round)
        request = await asyncio.wait_for(ended, 30)
        assert request.action == "succeed"


@pytest.mark.parametrize("nodes", [4, 16])
async def test_etcd_a_node_reads_counts_at_the_jobs_end_and_the_last_reads_the_marks(
    nodes: int, etcd: ClusterFactory, full_reads: list[str]
) -> None:
    endpoint = (await etcd(1)).rdzv_endpoint
    coordinators = etcd_coordinators(endpoint, nodes, f"end{nodes}")
    try:
        order = await joined(coordinators)
        healthy = await end_of_job(order, full_reads)
    finally:
        for coordinator in coordinators:
            await coordinator.close()
    assert healthy == [nodes - 1] * (nodes - 1)
    assert sorted(full_reads) == ["succeeded", "unhealthy"]
