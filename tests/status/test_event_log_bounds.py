"""The event log's bounds (issue 39 item 4): what a rank's messages may add to it (a token
bucket per rank, on a fake clock) and events.jsonl's rotation by size."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from ftd.status.event_kind import EventKind
from ftd.status.events import (
    RANK_EVENTS_BURST,
    RANK_EVENTS_PER_S,
    EventLog,
    RankBudget,
    rotated,
)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_rank_gets_its_burst_then_its_rate_and_a_flood_is_said_once() -> None:
    clock = Clock()
    log = EventLog(None, rank_budget=RankBudget(clock))
    for _ in range(RANK_EVENTS_BURST + 50):
        log.emit_for_rank(3, EventKind.WORKLOAD_CONTROL, rank=3)
    kinds = [event.kind for event in log.since(0)]
    assert kinds.count(EventKind.WORKLOAD_CONTROL) == RANK_EVENTS_BURST
    assert kinds.count(EventKind.BUDGET_EXCEEDED) == 1
    assert log.rank_budget.counts() == {"events": 50}
    log.emit_for_rank(4, EventKind.WORKLOAD_CONTROL, rank=4)  # another rank has its own
    assert log.since(0)[-1].data == {"rank": 4}
    clock.t += 1.0
    for _ in range(100):
        log.emit_for_rank(3, EventKind.WORKLOAD_CONTROL, rank=3)
    kinds = [event.kind for event in log.since(0)]
    assert kinds.count(EventKind.WORKLOAD_CONTROL) == RANK_EVENTS_BURST + 1 + RANK_EVENTS_PER_S
    assert kinds.count(EventKind.BUDGET_EXCEEDED) == 1  # the same flood
    clock.t += 2 * RANK_EVENTS_BURST / RANK_EVENTS_PER_S  # refilled: a new flood is said
    for _ in range(RANK_EVENTS_BURST + 1):
        log.emit_for_rank(3, EventKind.WORKLOAD_CONTROL, rank=3)
    assert [e.kind for e in log.since(0)].count(EventKind.BUDGET_EXCEEDED) == 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.floats(0, 5)), max_size=400))
def test_no_rank_ever_records_more_than_its_burst_and_rate(calls: list[tuple[int, float]]) -> None:
    clock = Clock()
    budget = RankBudget(clock)
    taken: dict[int, int] = {}
    for rank, pause in calls:
        clock.t += pause
        if budget.take(rank):
            taken[rank] = taken.get(rank, 0) + 1
    for count in taken.values():
        assert count <= RANK_EVENTS_BURST + clock.t * RANK_EVENTS_PER_S + 1e-6


def test_events_jsonl_rotates_by_size_and_ids_go_on(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, max_journal_bytes=4096)
    for i in range(200):
        log.emit(EventKind.STATE_CHANGED, n=i)
    log.close()
    assert path.stat().st_size < 4096 + 200 and rotated(path).stat().st_size >= 4096
    assert not (tmp_path / "events.jsonl.new").exists()
    lines = [json.loads(line) for f in (rotated(path), path) for line in f.read_text().splitlines()]
    assert [event["id"] for event in lines] == list(range(lines[0]["id"], 201))
    assert (path.stat().st_mode & 0o777, rotated(path).stat().st_mode & 0o777) == (0o600, 0o600)
    path.replace(rotated(path))  # just rotated: the next daemon's ids follow the older file's
    path.write_bytes(b"")
    assert EventLog(path).emit(EventKind.STATE_CHANGED).id == 201


def test_a_rotation_that_cannot_be_done_loses_no_event(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, max_journal_bytes=1024)
    (tmp_path / "events.jsonl.new").mkdir()  # in the way: the rotation is put off
    for i in range(100):
        log.emit(EventKind.STATE_CHANGED, n=i)
    log.close()
    assert len(path.read_text().splitlines()) == 100 and not rotated(path).exists()
