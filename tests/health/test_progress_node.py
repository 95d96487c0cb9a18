"""The node's progress for the operator (ftd/health/progress_node.py through ProgressWatch):
the slowest rank's steps and pace, the time spent making steps and the time lost, on a fake
clock."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from ftd_client.messages import ProgressReport

from ftd.health.links import RankHealth
from ftd.health.progress import ProgressWatch
from tests.support.wire import progress

WALL = 1_800_000_000.0
"""The wall clock at monotonic 0."""


def ranks(n: int) -> list[RankHealth]:
    return [RankHealth(i, i, 1000 + i, attached_at=0.0) for i in range(n)]


def report(steps: int) -> ProgressReport:
    return progress({"steps": steps, "entered": 2 * steps, "called": 0, "returned": 0})


def view(watch: ProgressWatch, now: float) -> dict[str, Any]:
    return watch.node_view(now, WALL + now)


def steps(watch: ProgressWatch, group: list[RankHealth], first: int, last: int, at: float) -> float:
    """Steps `first`..`last` of every rank, one a second from `at`, rank 1 a step behind
    rank 0 at the end; the time of the last."""
    now = at
    for step in range(first, last + 1):
        now = at + (step - first)
        watch.observe(group[0], 0, report(step), now)
        watch.observe(group[1], 1, report(step - 1 if step == last else step), now)
    return now


def test_before_the_job_begins_nothing_is_lost() -> None:
    watch = ProgressWatch()
    assert view(watch, 5.0) == {
        "steps": None,
        "steps_per_s": 0.0,
        "making_steps_s": 0.0,
        "time_lost_s": None,
        "since": None,
    }


def test_a_crash_and_restart_is_time_lost_and_the_slowest_rank_sets_the_pace() -> None:
    watch, group = ProgressWatch(), ranks(2)
    watch.attach(now=10.0)  # the ranks start; their first step comes 4 s later
    last = steps(watch, group, 1, 11, at=14.0)  # 10 s making steps
    node = view(watch, last)
    assert node["steps"] == 10  # rank 1, a step behind
    assert node["steps_per_s"] == pytest.approx(1.0)
    assert node["making_steps_s"] == pytest.approx(10.0)
    assert node["time_lost_s"] == pytest.approx(4.0)
    assert node["since"] == pytest.approx(WALL + 10.0)
    # A step learned of late (its reports come every 0.5 s) is no slower pace.
    assert view(watch, last + 1.0)["steps_per_s"] == pytest.approx(1.0)
    # Rank 1 crashes: no step for 5 s, the pace falls, the time is lost.
    node = view(watch, last + 5.0)
    assert node["steps_per_s"] == pytest.approx(1 / 6, abs=1e-6)  # its last step was 6 s ago
    assert node["time_lost_s"] == pytest.approx(9.0)
    for rank in group:
        watch.forget(rank, rank.local_rank)
    assert view(watch, last + 6.0)["steps_per_s"] == 0.0
    assert view(watch, last + 6.0)["steps"] == 10  # the last attempt's, after its ranks ended
    # The restart: 3 s later its ranks start, 2 s later they step again for 5 s.
    watch.attach(now=last + 8.0)
    group = ranks(2)
    end = steps(watch, group, 1, 6, at=last + 10.0)
    node = view(watch, end)
    assert node["making_steps_s"] == pytest.approx(15.0)
    assert node["time_lost_s"] == pytest.approx((end - 10.0) - 15.0)
    assert node["time_lost_s"] == pytest.approx(4.0 + 10.0)  # the start, the crash to resumed
    assert node["steps"] == 5 and node["since"] == pytest.approx(WALL + 10.0)


def test_a_report_of_steps_made_earlier_dates_them_by_their_age() -> None:
    """A rank's report says how long ago its last step was (`age_ms`): the span ends there."""
    watch, [rank] = ProgressWatch(), ranks(1)
    watch.attach(now=0.0)
    watch.observe(rank, 0, replace(report(1), age_ms=0), 1.0)
    watch.observe(rank, 0, replace(report(3), age_ms=500), 3.0)
    node = view(watch, 3.0)
    assert node["making_steps_s"] == pytest.approx(1.5)
    assert node["time_lost_s"] == pytest.approx(1.5)
    assert node["steps_per_s"] == pytest.approx(1 / 0.75, abs=1e-6)
