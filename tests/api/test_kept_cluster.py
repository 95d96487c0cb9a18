"""One read of the cluster serves the pages asked while it is young (issue 43, item 6;
ftd/api/kept_cluster.py): the rule as properties on a fake clock, the keeper's sharing, dropping
and failing on a fake read (the coordinator's read has its own tests), and the keeper over real
c10d coordinators on a real TCPStore."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftd.api.cluster_view import prepare
from ftd.api.kept_cluster import READ_SHARE, Kept, KeptClusterView, Step, kept_view_step
from ftd.tasks import Background
from tests.conftest import free_port
from tests.coordination.test_job_times import c10d_coordinators, joined

seconds = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)


def kept_at(read_at: float, took_s: float, key: object = 1) -> Kept:
    return Kept(prepare({"nodes": []}), read_at, took_s, key)


@given(read_at=seconds, took_s=st.floats(min_value=1e-6, max_value=10.0), age=seconds)
def test_a_view_is_served_while_young_and_read_again_once_old(
    read_at: float, took_s: float, age: float
) -> None:
    kept = kept_at(read_at, took_s)
    step = kept_view_step(read_at + age, kept, 1)
    fresh_s = took_s / READ_SHARE
    if age <= fresh_s * (1 - 1e-9):
        assert step is Step.SERVE
    elif age > 2 * fresh_s * (1 + 1e-9):
        assert step is Step.READ
    else:
        assert step in (Step.SERVE, Step.SERVE_AND_READ)
    assert kept_view_step(read_at + age, kept, 2) is Step.READ  # another round's view
    assert kept_view_step(read_at + age, None, 1) is Step.READ


@given(
    took_s=st.floats(min_value=1e-4, max_value=1.0),
    gaps=st.lists(st.floats(min_value=0.0, max_value=5.0), min_size=1, max_size=200),
)
def test_reading_takes_at_most_its_share_of_the_time_however_often_pages_come(
    took_s: float, gaps: list[float]
) -> None:
    """Pages at any times (reads finishing before the next page): the reads take at most
    READ_SHARE of the time between the first and the last, plus the one read after the last."""
    now, kept, reading_s = 0.0, None, 0.0
    for gap in gaps:
        now += gap
        step = kept_view_step(now, kept, 1)
        if step is not Step.SERVE:
            reading_s += took_s
            kept = kept_at(now, took_s)
    assert reading_s <= READ_SHARE * now + took_s * (1 + 1e-9)


class Reads:
    """A coordinator's cluster read that answers when told to."""

    def __init__(self) -> None:
        self.started = 0
        self.answers: asyncio.Queue[dict[str, Any] | Exception] = asyncio.Queue()

    async def read(self) -> dict[str, Any]:
        self.started += 1
        answer = await self.answers.get()
        if isinstance(answer, Exception):
            raise answer
        return answer


async def until(condition: Callable[[], bool]) -> None:
    """Let the loop run the tasks started until `condition` holds (no clock involved)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the loop ran out of work before the condition held")


def view(n: int) -> dict[str, Any]:
    nodes = [{"node_id": f"n{i}", "state": "running", "time": float(i)} for i in range(n)]
    return {"nodes": nodes, "round": {"round": 1, "members": [f"n{i}" for i in range(n)]}}


async def test_pages_at_once_share_one_read_and_young_pages_read_nothing() -> None:
    reads, background, now = Reads(), Background(), [100.0]
    kept = KeptClusterView(reads.read, background, clock=lambda: now[0])
    pages = [asyncio.ensure_future(kept.page(1, 0, 2)) for _ in range(5)]
    await until(lambda: reads.started == 1)
    now[0] += 0.01  # the read took 10 ms: fresh for 0.5 s
    await reads.answers.put(view(3))
    answers = await asyncio.gather(*pages)
    assert reads.started == 1 and kept.reads == 1
    assert all(a["total_nodes"] == 3 and len(a["nodes"]) == 2 for a in answers)
    now[0] += 0.4
    young = await kept.page(1, 2, 2)
    assert reads.started == 1 and [n["node_id"] for n in young["nodes"]] == ["n2"]
    assert young["view_age_s"] == pytest.approx(0.41)
    now[0] += 0.3  # 0.71 s old: served, a read starts beside
    served = await kept.page(1, 0, 64)
    assert served["total_nodes"] == 3
    await until(lambda: reads.started == 2)
    await reads.answers.put(view(4))
    await until(lambda: kept.reads == 2)
    assert (await kept.page(1, 0, 64))["total_nodes"] == 4
    now[0] += 5.0  # old: the page waits for a read
    waiting = asyncio.ensure_future(kept.page(1, 0, 64))
    await until(lambda: reads.started == 3)
    assert not waiting.done()
    await reads.answers.put(view(5))
    assert (await waiting)["total_nodes"] == 5
    await background.close()


async def test_a_drop_or_another_round_waits_for_a_read_made_after_it() -> None:
    reads, background, now = Reads(), Background(), [0.0]
    kept = KeptClusterView(reads.read, background, clock=lambda: now[0])
    first = asyncio.ensure_future(kept.page(1, 0, 64))
    await until(lambda: reads.started == 1)
    kept.drop()  # this node excluded a node while a read ran
    second = asyncio.ensure_future(kept.page(1, 0, 64))
    await until(lambda: reads.started == 2)
    await reads.answers.put(view(1))
    await reads.answers.put(view(2))
    assert (await first)["total_nodes"] == 1 and (await second)["total_nodes"] == 2
    assert (await kept.page(1, 0, 64))["total_nodes"] == 2 and reads.started == 2
    later_round = asyncio.ensure_future(kept.page(2, 0, 64))
    await until(lambda: reads.started == 3)
    await reads.answers.put(view(7))
    assert (await later_round)["total_nodes"] == 7
    await background.close()


async def test_a_failed_read_fails_its_pages_keeps_nothing_and_the_next_page_reads() -> None:
    reads, background = Reads(), Background()
    kept = KeptClusterView(reads.read, background, clock=lambda: 0.0)
    pages = [asyncio.ensure_future(kept.page(1, 0, 64)) for _ in range(2)]
    await until(lambda: reads.started == 1)
    await reads.answers.put(RuntimeError("the store did not answer"))
    for page in pages:
        with pytest.raises(RuntimeError):
            await page
    again = asyncio.ensure_future(kept.page(1, 0, 64))
    await until(lambda: reads.started == 2)
    await reads.answers.put(view(2))
    assert (await again)["total_nodes"] == 2 and reads.started == 2
    await background.close()


async def test_a_page_whose_caller_left_does_not_cancel_the_read_others_wait_for() -> None:
    reads, background = Reads(), Background()
    kept = KeptClusterView(reads.read, background, clock=lambda: 0.0)
    left = asyncio.ensure_future(kept.page(1, 0, 64))
    stays = asyncio.ensure_future(kept.page(1, 0, 64))
    await until(lambda: reads.started == 1)
    left.cancel()
    await reads.answers.put(view(3))
    assert (await stays)["total_nodes"] == 3 and reads.started == 1
    await background.close()


async def test_real_c10d_pages_share_reads_and_show_a_change_once_the_view_is_old() -> None:
    from ftd_client.store import tcp_store_server

    port = free_port()
    server = tcp_store_server("127.0.0.1", port)
    coordinators = c10d_coordinators(port, 2)
    background = Background()
    try:
        first, second = await joined(coordinators)
        now = [0.0]
        kept = KeptClusterView(first.cluster, background, clock=lambda: now[0])
        rnd = first.round
        assert rnd is not None
        pages = await asyncio.gather(*(kept.page(rnd.number, 0, 64) for _ in range(8)))
        assert kept.reads == 1
        assert all(p["total_nodes"] == 2 and p["counts"]["state"] == {"running": 2} for p in pages)
        store = second._connections.operations.store
        store.set("status/n01", b"garbage")
        assert (await kept.page(rnd.number, 0, 64))["counts"]["state"] == {"running": 2}
        now[0] += 3600.0
        shown = await kept.page(rnd.number, 0, 64)
        assert shown["counts"]["state"] == {"running": 1, "unknown": 1} and kept.reads == 2
    finally:
        await background.close()
        for coordinator in coordinators:
            await coordinator.close()
        del server
