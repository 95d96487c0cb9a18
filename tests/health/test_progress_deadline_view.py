"""The deadline in force in each rank's progress view, on a fake clock (issue 44, item 6): the
operator sees the same deadline and the same age the verdict is given by
(ftd/health/progress.py, `ProgressWatch.in_force`)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ftd.health.links import RankHealth
from ftd.health.progress import AUTO_SECTION_DEFAULT_S, PROGRESS_FACTOR, ProgressWatch
from tests.health.test_progress_watch import FLOOR, ranks, report, train


def deadline(watch: ProgressWatch, rank: RankHealth, now: float) -> dict[str, Any]:
    view = watch.view(rank, now)
    assert view is not None
    return {k: v for k, v in view.items() if k.startswith("progress_deadline")}


def test_the_view_names_the_progress_deadline_and_the_time_counted_against_it() -> None:
    watch, [rank] = ProgressWatch(FLOOR), ranks(1)
    watch.observe(rank, 0, report(0, 0), 1.0)  # set-up: nothing is timed yet
    assert deadline(watch, rank, 4.0) == {
        "progress_deadline_s": FLOOR,
        "progress_deadline_name": "progress",
        "progress_deadline_age_s": None,
    }
    now = train(watch, [rank], 10, 0.1)
    assert deadline(watch, rank, now + 2.5)["progress_deadline_age_s"] == 2.5
    # A long interval teaches the deadline: the view shows the learned one.
    watch.observe(rank, 0, report(11, 22), now + 4.0)
    assert deadline(watch, rank, now + 5.0) == {
        "progress_deadline_s": PROGRESS_FACTOR * 4.0,
        "progress_deadline_name": "progress",
        "progress_deadline_age_s": 1.0,
    }


def test_inside_an_automatic_section_its_deadline_is_in_force() -> None:
    watch, [rank] = ProgressWatch(FLOOR), ranks(1)
    now = train(watch, [rank], 10, 0.1)
    watch.observe(rank, 0, report(10, 20, {"auto:torch.save": 500}), now + 1.0)
    assert deadline(watch, rank, now + 3.0) == {
        "progress_deadline_s": AUTO_SECTION_DEFAULT_S,
        "progress_deadline_name": "auto:torch.save",
        "progress_deadline_age_s": 2.5,  # from when the section opened, 0.5 s before the report
    }


def test_with_progress_off_no_deadline_is_shown() -> None:
    watch, [rank] = ProgressWatch(FLOOR, enabled=False), ranks(1)
    now = train(watch, [rank], 5, 0.1)
    assert set(deadline(watch, rank, now + 100).values()) == {None}


@settings(max_examples=200, deadline=None)
@given(
    steps=st.integers(1, 20),
    dt=st.floats(0.01, 3.0),
    reads=st.lists(st.floats(0.0, 60.0), min_size=1, max_size=10),
)
def test_a_verdict_is_due_exactly_when_the_age_shown_reaches_the_deadline_shown(
    steps: int, dt: float, reads: list[float]
) -> None:
    """Whatever the pace the deadline was learned from, the operator's view never says "within
    the deadline" when the verdict is due, nor past it when it is not."""
    watch, [rank] = ProgressWatch(FLOOR), ranks(1)
    stopped = train(watch, [rank], steps, dt)
    for later in sorted(reads):
        now = stopped + later
        shown = deadline(watch, rank, now)
        due = shown["progress_deadline_age_s"] >= shown["progress_deadline_s"]
        # The view rounds the age to the millisecond: judge away from that edge.
        if abs(now - stopped - shown["progress_deadline_s"]) > 0.001:
            assert (watch.check(now) is not None) == due, (shown, later)
