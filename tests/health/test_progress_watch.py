"""The progress watch's verdicts on a fake clock: when a rank without progress is judged, which
rank is the culprit, and what never leads to a verdict (ftd/health/progress.py)."""

from __future__ import annotations

from typing import Any

from ftd_client.messages import ProgressReport
from hypothesis import given, settings
from hypothesis import strategies as st

from ftd.health.links import RankHealth
from ftd.health.progress import (
    AUTO_SECTION_DEFAULT_S,
    PROGRESS_FACTOR,
    STALLED_AFTER_S,
    ProgressWatch,
)
from tests.support.wire import progress

FLOOR = 5.0


def ranks(n: int) -> list[RankHealth]:
    return [RankHealth(i, i, 1000 + i, attached_at=0.0) for i in range(n)]


def report(steps: int, entered: int, auto: dict[str, int] | None = None) -> ProgressReport:
    fields: dict[str, Any] = {"steps": steps, "entered": entered, "called": 0, "returned": 0}
    if auto:
        fields["auto"] = auto
    return progress(fields)


def train(watch: ProgressWatch, group: list[RankHealth], steps: int, dt: float) -> float:
    """`steps` steps of every rank, `dt` apart, two collectives each; the time after."""
    now = 0.0
    for step in range(1, steps + 1):
        now = step * dt
        for rank in group:
            watch.observe(rank, rank.local_rank, report(step, 2 * step), now)
            assert watch.check(now) is None
    return now


def test_the_rank_the_others_wait_on_is_the_culprit_at_the_floor() -> None:
    watch, group = ProgressWatch(FLOOR), ranks(3)
    now = train(watch, group, 10, 0.1)
    # Rank 1 stops; ranks 0 and 2 enter the next collective and block in it.
    for rank in (group[0], group[2]):
        watch.observe(rank, rank.local_rank, report(10, 21), now + 0.05)
    assert watch.check(now + FLOOR - 0.01) is None
    verdict = watch.check(now + FLOOR + 0.01)
    assert verdict is not None
    assert verdict.culprit.rank is group[1]
    assert [v.rank for v in verdict.victims] == [group[0], group[2]]
    assert "has not entered collective 21" in verdict.reason


@settings(max_examples=200, deadline=None)
@given(
    world=st.integers(2, 8),
    culprit=st.data(),
    dt=st.floats(0.01, 3.0),
    extra=st.lists(st.integers(1, 5), min_size=8, max_size=8),
)
def test_the_culprit_is_the_fewest_entered_and_never_judged_early(
    world: int, culprit: st.DataObject, dt: float, extra: list[int]
) -> None:
    watch, group = ProgressWatch(FLOOR), ranks(world)
    now = train(watch, group, 5, dt)
    stopped = culprit.draw(st.integers(0, world - 1))
    for rank in group:
        if rank is not group[stopped]:  # the others get further, each in its own collective
            watch.observe(rank, rank.local_rank, report(5, 10 + extra[rank.local_rank]), now + dt)
    deadline = max(FLOOR, PROGRESS_FACTOR * dt)
    assert watch.check(now + deadline - 1e-3) is None
    verdict = watch.check(now + deadline + 1e-3)
    assert verdict is not None and verdict.culprit.rank is group[stopped]


def test_an_automatic_section_is_judged_by_its_own_deadline() -> None:
    """Rank 0 is in a slow torch.save while rank 1 waits in the barrier after it."""
    watch, group = ProgressWatch(FLOOR), ranks(2)
    now = train(watch, group, 10, 0.1)
    watch.observe(group[0], 0, report(10, 20, {"auto:torch.save": 0}), now)
    watch.observe(group[1], 1, report(10, 21), now)
    assert watch.check(now + 15) is None
    assert watch.check(now + AUTO_SECTION_DEFAULT_S - 1) is None
    verdict = watch.check(now + AUTO_SECTION_DEFAULT_S + 1)
    assert verdict is not None and verdict.culprit.rank is group[0]
    assert "inside auto:torch.save" in verdict.reason


def test_a_rank_that_waited_on_a_long_phase_is_timed_from_its_end() -> None:
    """The slow torch.save ends (rank 0's report says so) before rank 1's next report says it
    left the barrier: rank 1 waited on rank 0, it is not the culprit of those 15 s (seen on
    a clean clone: rank 1 judged at the floor in the moment between the two reports)."""
    watch, group = ProgressWatch(FLOOR), ranks(2)
    now = train(watch, group, 10, 0.1)
    watch.observe(group[0], 0, report(10, 20, {"auto:torch.save": 0}), now)
    watch.observe(group[1], 1, report(10, 21), now)
    watch.observe(group[0], 0, report(10, 21), now + 15)
    assert watch.check(now + 15.1) is None
    assert watch.check(now + 15 + FLOOR - 0.01) is None
    verdict = watch.check(now + 15 + FLOOR + 0.01)  # still nothing from either: a hang
    assert verdict is not None


def test_a_section_seen_to_end_learns_its_deadline() -> None:
    watch, group = ProgressWatch(FLOOR), ranks(1)
    now = train(watch, group, 3, 0.1)
    watch.observe(group[0], 0, report(3, 6, {"auto:torch.save": 0}), now)
    watch.observe(group[0], 0, report(3, 6), now + 4.0)
    assert watch.auto_deadline_s("auto:torch.save") == 12.0
    watch.observe(group[0], 0, report(3, 6, {"auto:torch.save": 0}), now + 5.0)
    assert watch.check(now + 5.0 + 11.9) is None
    assert watch.check(now + 5.0 + 12.1) is not None


def test_evaluation_with_collectives_and_no_steps_is_progress() -> None:
    watch, group = ProgressWatch(FLOOR), ranks(2)
    now = train(watch, group, 10, 0.1)
    for tick in range(1, 151):  # 15 s, an all_reduce every 100 ms, no optimizer step
        for rank in group:
            watch.observe(rank, rank.local_rank, report(10, 20 + tick), now + tick * 0.1)
        assert watch.check(now + tick * 0.1) is None


def test_nothing_is_judged_before_the_first_step_or_when_off() -> None:
    watch, group = ProgressWatch(FLOOR), ranks(2)
    for rank in group:  # set-up: collectives, no step
        watch.observe(rank, rank.local_rank, report(0, 3), 0.0)
    assert watch.check(1000.0) is None
    off = ProgressWatch(FLOOR, enabled=False)
    train(off, group, 3, 0.1)
    assert off.check(1000.0) is None


def test_the_deadline_is_learned_from_the_longest_interval() -> None:
    watch, group = ProgressWatch(FLOOR), ranks(1)
    now = train(watch, group, 3, 0.1)
    watch.observe(group[0], 0, report(4, 8), now + 4.0)  # one 4 s step
    assert watch.deadline_s == 12.0
    assert watch.check(now + 4.0 + 11.9) is None
    assert watch.check(now + 4.0 + 12.1) is not None


def test_a_paused_daemon_blames_no_one_for_its_pause() -> None:
    watch, group = ProgressWatch(FLOOR), ranks(2)
    now = train(watch, group, 3, 0.1)
    watch.paused(60.0)
    assert watch.check(now + 60.0 + FLOOR - 0.1) is None
    assert watch.check(now + 60.0 + FLOOR + 0.1) is not None


def test_a_rank_whose_reports_ended_stops_no_one() -> None:
    watch, group = ProgressWatch(FLOOR), ranks(2)
    now = train(watch, group, 3, 0.1)
    watch.forget(group[1], link=1)
    watch.observe(group[0], 0, report(4, 8), now + 100)
    assert watch.check(now + 101) is None
    watch.forget(group[0], link=99)  # another connection of the rank: its reports go on
    assert watch.check(now + 100 + watch.deadline_s + 0.1) is not None


def test_a_rank_that_exited_still_counts_in_its_nodes_part_of_the_jobs_culprit() -> None:
    """A rank blocked in a collective on a peer that was killed may exit before its node's
    collectives are taken: they are taken with its last counts (seen under load, 1 run in 6)."""
    from ftd.health.collectives import AttemptCollectives

    watch, group = ProgressWatch(FLOOR), ranks(2)
    now = train(watch, group, 3, 0.1)
    watch.observe(group[0], 0, report(3, 7), now + 0.01)  # rank 0 waits in collective 7
    watch.forget(group[0], link=0)
    watch.forget(group[1], link=1)
    assert watch.reporting() == [] and len(watch.reported()) == 2
    collectives = AttemptCollectives(watch)
    collectives.freeze(judged=False)
    frozen = collectives.frozen
    assert frozen is not None and (frozen.lowest, frozen.rank, frozen.waiting) == (6, 1, 1)
    watch.attach(now + 1)
    assert watch.reported() == []  # a new attempt starts afresh


def test_a_heartbeat_verdict_names_the_rank_the_others_wait_on() -> None:
    watch, group = ProgressWatch(FLOOR), ranks(2)
    now = train(watch, group, 3, 0.1)
    watch.observe(group[0], 0, report(3, 7), now + 0.01)  # rank 0 waits in collective 7
    later = now + STALLED_AFTER_S + 1
    assert watch.culprit([group[0]], later) is group[1]  # rank 0 timed out first
    assert "rank 1 is the culprit" in watch.blame(group[1], [group[0]])
    tied = ProgressWatch(FLOOR)
    train(tied, group, 3, 0.1)
    assert tied.culprit([group[0]], later) is None  # nothing tells them apart: silence does
    assert ProgressWatch(FLOOR).culprit([group[0]], later) is None  # no reports at all


def test_a_long_set_up_is_not_judged_when_the_first_step_is_reported() -> None:
    """Both ranks spend 9 s joining the group (a busy machine); rank 1's first steps are
    reported, rank 0's (it steps in lockstep) a sampler interval later: no verdict. Seen in
    bench/hang_blame.py: rank 0 judged 'no progress for 9.608s (0 steps, 0 collectives)'."""
    watch, group = ProgressWatch(FLOOR), ranks(2)
    for rank in group:
        watch.observe(rank, rank.local_rank, report(0, 0), 0.0)
    watch.observe(group[1], 1, report(3, 8), 9.0)
    assert watch.check(9.0) is None
    assert watch.check(9.0 + FLOOR - 0.01) is None
    watch.observe(group[0], 0, report(3, 8), 9.4)
    assert watch.check(9.5) is None
    # Judging has begun: a rank that never reports again is judged a deadline later.
    watch.observe(group[1], 1, report(4, 10), 9.5)
    verdict = watch.check(9.4 + FLOOR + 0.01)
    assert verdict is not None and verdict.culprit.rank is group[0]
    assert "has not entered collective 9" in verdict.reason


def test_a_rank_silent_since_set_up_is_timed_from_the_first_step() -> None:
    watch, group = ProgressWatch(FLOOR), ranks(2)
    for rank in group:
        watch.observe(rank, rank.local_rank, report(0, 0), 0.0)
    watch.observe(group[1], 1, report(1, 2), 20.0)  # rank 0 never reports again
    assert watch.check(20.0 + FLOOR - 0.01) is None
    verdict = watch.check(20.0 + FLOOR + 0.01)
    assert verdict is not None and verdict.culprit.rank is group[0]
    assert f"made no progress for {FLOOR + 0.01:.3f}s" in verdict.reason


def test_an_explicit_section_wins_over_progress() -> None:
    """A rank inside its script's own section (ftd_client's or NVRx's) is judged by that
    section's timeout (the monitor), not by the progress deadline."""
    watch, group = ProgressWatch(FLOOR), ranks(2)
    now = train(watch, group, 3, 0.1)
    watch.observe(group[0], 0, report(3, 7), now)  # rank 0 waits for rank 1 in a collective
    group[1].open_sections["checkpointing"] = now
    assert watch.check(now + 100 * FLOOR) is None
    del group[1].open_sections["checkpointing"]
    verdict = watch.check(now + 100 * FLOOR)
    assert verdict is not None and verdict.culprit.rank is group[1]


def test_a_section_without_a_timeout_leaves_the_rank_to_the_progress_deadline() -> None:
    """Issue 39 row 6: only a section whose timeout is in force is left to the monitor (the
    predicate is the monitor's `section_timed`); inside an untimed one, progress judges."""
    watch, group = ProgressWatch(FLOOR), ranks(2)
    now = train(watch, group, 3, 0.1)
    watch.observe(group[0], 0, report(3, 7), now)
    group[1].open_sections["untimed"] = now
    timed = {"checkpointing"}

    def section_timed(rank: RankHealth) -> bool:
        return any(name in timed for name in rank.open_sections)

    verdict = watch.check(now + FLOOR + 1, section_timed)
    assert verdict is not None and verdict.culprit.rank is group[1]
    group[1].open_sections["checkpointing"] = now
    assert watch.check(now + 100 * FLOOR, section_timed) is None


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.lists(st.floats(0.01, 3.0), min_size=1, max_size=20))
def test_no_verdict_is_due_before_next_due(n: int, gaps: list[float]) -> None:
    """The progress timer sleeps until next_due: no check before it may give a verdict."""
    watch, group = ProgressWatch(FLOOR), ranks(n)
    now = train(watch, group, 3, 0.1)
    for i, gap in enumerate(gaps):  # rank 0 moves on now and then; the others stop
        now += gap
        watch.observe(group[0], 0, report(4 + i, 10 + 2 * i), now)
        due = watch.next_due()
        assert due is not None
        for t in (now, (now + due) / 2, due - 1e-6):
            if now <= t < due:
                assert watch.check(t) is None, (t, due)
    due = watch.next_due()
    assert due is not None
    assert watch.check(max(due, now) + FLOOR * PROGRESS_FACTOR * 10) is not None
