"""A restart's stages (ftd/supervision/recovery.py): they add up to the total, and restore and
redo are measured only where the new ranks restored a snapshot."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftd.supervision.recovery import STAGES, Recovery


def _recovery(**marks: float | None) -> Recovery:
    base: dict[str, float | None] = {
        "stopped": 100.3,
        "backed_off": 100.3,
        "rendezvous": 100.4,
        "spawned": 100.5,
        "resumed": 103.0,
    }
    return Recovery("rank 1 exited", 100.0, 100.1, **{**base, **marks})  # type: ignore[arg-type]


def test_without_a_restore_init_runs_to_the_first_step() -> None:
    data = _recovery().event_data(1)
    assert list(data["stages"]) == list(STAGES)
    assert data["stages"]["init"] == pytest.approx(2.5)
    assert data["stages"]["restore"] is None and data["stages"]["redo"] is None
    assert data["total_s"] == pytest.approx(3.0)


def test_a_restore_splits_init_and_the_redo_ends_the_total() -> None:
    data = _recovery(restore_asked=102.0, caught_up=104.0).event_data(1)
    stages = data["stages"]
    assert (stages["init"], stages["restore"], stages["redo"]) == pytest.approx((1.5, 1.0, 1.0))
    assert data["total_s"] == pytest.approx(4.0)


def test_a_redo_not_over_yet_leaves_the_total_at_the_first_step() -> None:
    data = _recovery(restore_asked=102.0).event_data(1)
    assert data["stages"]["restore"] == pytest.approx(1.0) and data["stages"]["redo"] is None
    assert data["total_s"] == pytest.approx(3.0)


def test_a_restore_that_lost_nothing_is_caught_up_at_the_first_step() -> None:
    """Nothing lost: the job is back where it was when the restore began, before its first
    step; the redo is 0, never negative."""
    data = _recovery(restore_asked=102.0, caught_up=102.0).event_data(1)
    assert data["stages"]["redo"] == 0 and data["total_s"] == pytest.approx(3.0)


@pytest.mark.parametrize("asked", [100.2, 103.5])
def test_a_request_before_the_spawn_or_after_the_first_step_is_no_restore(asked: float) -> None:
    """A request from the attempt before (before the spawn), or after a first step (a heartbeat
    sent before the script restored): the start-up is all `init`."""
    stages = _recovery(restore_asked=asked, caught_up=104.0).stages()
    assert stages["init"] == pytest.approx(2.5) and stages["restore"] is None
    assert stages["redo"] is None


@given(st.lists(st.floats(0, 1000, allow_nan=False), min_size=9, max_size=9))
def test_ordered_marks_add_up_to_the_total(gaps: list[float]) -> None:
    marks = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    origin, decided, stopped, backed_off, rendezvous, spawned, asked, resumed, caught_up = marks
    recovery = Recovery(
        "x", origin, decided, stopped, backed_off, rendezvous, spawned, asked, resumed, caught_up
    )
    data = recovery.event_data(0)
    assert all(value is not None and value >= 0 for value in data["stages"].values())
    assert sum(data["stages"].values()) == pytest.approx(data["total_s"], abs=1e-5)
