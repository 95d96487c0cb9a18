"""What a node waiting in a forming round tells its board (ftd/coordination/progress.py): who
joined, who of the round before is missing, the time left, at once and at each later read;
nothing for a read that failed; None once the wait is over; in a large round, how many joined
and the names of a bounded few, from a bounded read. And the words `ftd status` makes of
it, job text escaped (ftd/cli/status_view.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from ftd.cli.status_view import waiting_text
from ftd.config.serve import ServeConfig
from ftd.coordination import progress
from ftd.coordination.base import Round
from ftd.coordination.c10d.record_store import RecordStore
from ftd.coordination.c10d.rounds import StoreRounds
from ftd.coordination.records import Member, RecordCodec, RoundMember
from ftd.coordination.shared_rounds import JOINED_NAMES_MAX
from ftd.status.model import Standby, Waiting
from tests.conftest import free_port
from tests.support.etcd_cluster import ClusterFactory

CONFIG = ServeConfig(
    entrypoint=__file__, node_id="a", nnodes_min=2, nnodes_max=3, rdzv_endpoint="h:29400"
)
LAST = Round.of_members(
    3,
    tuple(RoundMember(n, "h", 1, 1) for n in ("a", "b", "c")),
    0,
    0,
    {},
)


class Board:
    def __init__(self) -> None:
        self.seen: list[Waiting | None] = []
        self.changed = asyncio.Event()

    def standby(self, wait: Standby) -> None:
        raise AssertionError("no standby here")

    def waiting(self, wait: Waiting | None) -> None:
        self.seen.append(wait)
        self.changed.set()


async def test_the_board_hears_soon_and_the_wait_ends_with_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    board, reads = Board(), [["a"], OSError("store lost"), ["a", "c"]]

    async def joined(names: bool) -> tuple[int, list[str]]:
        assert names
        answer = reads.pop(0) if reads else ["a", "c"]
        if isinstance(answer, Exception):
            raise answer
        return len(answer), answer

    monkeypatch.setattr(progress, "PROGRESS_S", 0.01)
    monkeypatch.setattr(progress, "FIRST_LOOK_S", 0.01)
    deadline = asyncio.get_running_loop().time() + 100
    task = asyncio.create_task(progress.report_progress(CONFIG, 4, LAST, joined, deadline, board))
    while len(board.seen) < 2:
        board.changed.clear()
        await board.changed.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    first, second, *rest = board.seen
    assert rest[-1] is None and all(w is not None for w in rest[:-1])
    assert first is not None and second is not None
    assert (first.round, first.endpoint, first.nnodes_min, first.nnodes_max) == (4, "h:29400", 2, 3)
    assert first.joined == ("a",) and first.missing == ("b", "c")
    assert second.joined == ("a", "c") and second.missing == ("b",)  # the failed read: nothing
    assert 90 < first.gives_up_at - time.time() <= 100


def test_waiting_text_and_the_time_left_read_live() -> None:
    wait = Waiting(4, "h:29400", ("a",), ("b",), 2, 2, gives_up_at=time.time() + 583.2)
    shown = wait.to_dict()
    assert 582 < shown["left_s"] <= 583.2  # type: ignore[operator]
    line = waiting_text({"waiting": shown})
    assert line.startswith(
        "waiting for nodes in round 4 at h:29400: 1 of 2 joined (a); missing: b; gives up in 58"
    ), line
    assert "2 to 3" in waiting_text({"waiting": {**shown, "nnodes_max": 3}})
    hostile = waiting_text({"waiting": {**shown, "joined": ["\x1b]0;owned\x07"], "missing": 7}})
    assert "\x1b" not in hostile and "missing: none" in hostile, hostile
    assert waiting_text({"waiting": None}) == "" and waiting_text({}) == ""


async def test_a_large_round_is_counted_and_its_joiners_not_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past JOINED_NAMES_MAX joiners the wait says how many joined and reads no names (a node
    that joined past them asks for none at all); who is not back is not known and is not made
    up. A node that joined among the first reads names until it sees more joined."""
    board = Board()
    names = [f"n{i:04d}" for i in range(JOINED_NAMES_MAX)]
    asked: list[bool] = []

    async def joined(named: bool) -> tuple[int, list[str]]:
        asked.append(named)
        return 1000, names if named else []

    monkeypatch.setattr(progress, "FIRST_LOOK_S", 0.01)
    monkeypatch.setattr(progress, "PROGRESS_S", 0.01)
    deadline = asyncio.get_running_loop().time() + 100
    for known, first in ((3, True), (JOINED_NAMES_MAX + 1, False)):
        board.seen.clear()
        looks = progress.report_progress(CONFIG, 4, LAST, joined, deadline, board, known)
        task = asyncio.create_task(looks)
        while len(board.seen) < 2:
            board.changed.clear()
            await board.changed.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert asked[:2] == [first, False], asked
        asked.clear()
    wait = board.seen[0]
    assert wait is not None and wait.joined == () and wait.missing == ()
    shown = wait.to_dict()
    assert shown["joined_count"] == 1000
    line = waiting_text({"waiting": shown})
    assert ": 1000 of 2 to 3 joined (...); missing: none" in line, line
    some = waiting_text({"waiting": {**shown, "joined": names[:2], "joined_count": 5}})
    assert ": 5 of 2 to 3 joined (n0000, n0001, ...);" in some, some
    forged = waiting_text({"waiting": {**shown, "joined": names, "joined_count": -5}})
    assert f": {JOINED_NAMES_MAX} of 2 to 3 joined" in forged, forged  # never fewer than named


def test_a_waiting_c10d_node_reads_one_counter_and_a_bounded_number_of_join_records() -> None:
    """A round of 100 joiners on a real store: how many joined, from the counter; the first
    JOINED_NAMES_MAX records read, not every one (forged ones skipped)."""
    from ftd_client.store import tcp_store_server

    port = free_port()
    server = tcp_store_server("127.0.0.1", port)
    codec = RecordCodec("job", b"s" * 32)
    store = RecordStore("127.0.0.1", port, "ftd/job/", codec, 10)
    try:
        for i in range(1, 101):
            store.put(f"r0/node/{i}", Member(node_id=f"n{i:03d}", addr="h", nproc=1, store_port=1))
        store.set("r0/node/2", 'ftd1 - {"node_id": "mallory"}')  # unsigned: skipped
        store.add("r0/joined", 100)
        before = store.ops
        count, names = StoreRounds(CONFIG).joined_some(store, 0)
        assert count == 100 and len(names) == JOINED_NAMES_MAX - 1 and "n002" not in names
        assert names[0] == "n001" and names[-1] == f"n{JOINED_NAMES_MAX:03d}"
        assert store.ops - before <= 3  # the counter, and one read of the records
        before = store.ops
        assert StoreRounds(CONFIG).joined_some(store, 0, names=False) == (100, [])
        assert store.ops - before == 1  # the counter alone
        store.add("r1/joined", -5)  # forged below zero: none joined, none read
        assert StoreRounds(CONFIG).joined_some(store, 1) == (0, [])
    finally:
        store.close()
        del server


async def test_a_waiting_etcd_node_reads_one_range_bounded_and_past_64_one_record(
    etcd: ClusterFactory,
) -> None:
    """A round of 100 joiners in a real etcd: the count of one range; with names, its first
    JOINED_NAMES_MAX records (a forged one skipped), else one record read, for the count."""
    from ftd.coordination.etcd.coordinator import EtcdCoordinator

    members = await etcd(1)
    config = CONFIG.model_copy(
        update={"rdzv_backend": "etcd", "rdzv_endpoint": members.rdzv_endpoint, "run_id": "job"}
    )
    c = EtcdCoordinator(config, b"s" * 32, lambda kind, data: None)
    try:
        await c.start(lambda node, reason: None)
        for i in range(1, 101):
            joiner = Member(node_id=f"n{i:03d}", addr="h", nproc=1, store_port=1)
            await c._kv.put(f"r0/join/n{i:03d}", joiner)
        await c._kv.etcd.put("r0/join/n002", b'ftd1 - {"node_id": "mallory"}')
        before = c.ops
        count, names = await c._rounds.joined_some(0)
        assert count == 100 and len(names) == JOINED_NAMES_MAX - 1 and "n002" not in names
        refused = sum(c.codec.refused.values())
        assert await c._rounds.joined_some(0, names=False) == (100, [])
        assert c.ops - before == 2  # one range each
        assert sum(c.codec.refused.values()) == refused  # the forged record: not even decoded
    finally:
        await c.close()
