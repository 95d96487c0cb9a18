"""Stragglers on a fake clock: who is named, when, and what never is (ftd/health/stragglers.py),
and the timer's events and publishing (ftd/health/straggler_timer.py)."""

from __future__ import annotations

from typing import Any

from ftd_client.messages import ProgressReport
from hypothesis import given, settings
from hypothesis import strategies as st

from ftd.coordination.records import NodeSummary
from ftd.health.links import RankHealth
from ftd.health.progress import ProgressWatch
from ftd.health.straggler_timer import (
    MAX_PEER_RANKS,
    PUBLISH_S,
    StragglerTimer,
    moved,
    peer_forward,
    peer_times,
)
from ftd.health.stragglers import (
    MIN_EXCESS_S,
    SLOW_RATIO,
    SUSTAIN_S,
    StragglerChange,
    StragglerWatch,
    compare,
)
from ftd.status.events import EventLog

TICK = 0.5
WALL = 1_800_000_000.0


def run(
    watch: StragglerWatch,
    own: dict[int, float],
    seconds: float,
    start: float = 0.0,
    peers: dict[int, float] | None = None,
) -> list[tuple[float, StragglerChange]]:
    """Ticks every TICK from `start` for `seconds`; the changes with their times."""
    changes = []
    ticks = round(seconds / TICK)
    for i in range(1, ticks + 1):
        now = start + i * TICK
        changes += [(now, c) for c in watch.check(now, WALL + now, own, peers or {})]
    return changes


def test_a_rank_60ms_slower_than_its_peer_is_named_once_after_the_sustain_window() -> None:
    watch = StragglerWatch()
    slow = {0: 0.002, 1: 0.062}
    [(at, change)] = run(watch, slow, 60)
    assert change.kind == "straggler" and change.straggler.global_rank == 1
    assert at == TICK + SUSTAIN_S  # first seen slow at the first tick
    assert change.straggler.ratio == 31.0 and change.straggler.since == WALL + TICK
    assert "rank 1's forward pass takes 62.0 ms, 31x the median" in change.reason
    assert watch.view(1) == {"ratio": 31.0, "since": WALL + TICK, "signal": "forward"}
    assert watch.view(0) is None
    assert watch.listed() == [
        {"global_rank": 1, "ratio": 31.0, "since": WALL + TICK, "signal": "forward"}
    ]
    # it recovers: cleared once, SUSTAIN_S after it was first seen recovered
    [(cleared_at, cleared)] = run(watch, {0: 0.002, 1: 0.002}, 60, start=60)
    assert cleared.kind == "cleared" and cleared.straggler.global_rank == 1
    assert cleared_at == 60 + TICK + SUSTAIN_S
    assert watch.view(1) is None


def test_a_transient_slowdown_shorter_than_the_window_is_no_straggler() -> None:
    watch = StragglerWatch()
    assert run(watch, {0: 0.002, 1: 0.5}, SUSTAIN_S - TICK) == []
    assert run(watch, {0: 0.002, 1: 0.002}, 1, start=SUSTAIN_S) == []
    assert run(watch, {0: 0.002, 1: 0.5}, SUSTAIN_S - TICK, start=SUSTAIN_S + 1) == []


def test_tiny_forward_times_far_apart_in_ratio_are_noise() -> None:
    """40 us against 10 us: a ratio of 4, but 30 us is scheduling noise."""
    assert run(StragglerWatch(), {0: 10e-6, 1: 40e-6}, 60) == []


def test_a_rank_is_compared_with_the_other_nodes_ranks_and_only_its_own_are_judged() -> None:
    watch = StragglerWatch()
    peers = {0: 0.050, 2: 0.051, 3: 0.049, 4: 0.5, 5: 0.05}  # rank 4 is another node's to judge
    [(_, change)] = run(watch, {1: 0.080}, 30, peers=peers)
    assert change.straggler.global_rank == 1 and change.median_s == 0.050
    assert change.straggler.ratio == 1.6
    # alone on its node, without peers there is nothing to compare with
    assert run(StragglerWatch(), {1: 0.080}, 30) == []


def test_a_straggler_that_is_gone_is_cleared() -> None:
    watch = StragglerWatch()
    assert len(run(watch, {0: 0.002, 1: 0.062}, 20)) == 1
    [change] = watch.check(100.0, WALL, {0: 0.002}, {})
    assert change.kind == "cleared" and change.reason == "the rank is gone"


forward_maps = st.dictionaries(
    st.integers(0, 5), st.sampled_from([0.0, 0.001, 0.002, 0.011, 0.05, 0.06, 0.3]), max_size=6
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(forward_maps, st.integers(1, 30)), min_size=1, max_size=12))
def test_every_straggler_was_slow_for_the_whole_window_and_events_alternate(
    phases: list[tuple[dict[int, float], int]],
) -> None:
    """Property: a rank is named only after being slow (SLOW_RATIO and MIN_EXCESS_S against
    the median of the others) at every tick of the last SUSTAIN_S; per rank, events alternate
    straggler, cleared; the fastest rank and ranks with equal times are never named."""
    watch = StragglerWatch()
    now, seen_slow_since, named = 0.0, dict[int, float](), dict[int, bool]()
    for forward, ticks in phases:
        for _ in range(ticks):
            now += TICK
            for rank in forward:
                seen = compare(rank, forward)
                if seen is not None and seen.slow:
                    seen_slow_since.setdefault(rank, now)
                else:
                    seen_slow_since.pop(rank, None)
            for change in watch.check(now, WALL + now, forward, {}):
                rank = change.straggler.global_rank
                if change.kind == "straggler":
                    assert not named.get(rank)
                    assert now - seen_slow_since[rank] >= SUSTAIN_S
                    assert forward[rank] > min(forward.values())
                    assert change.straggler.ratio >= SLOW_RATIO
                    assert change.seconds is not None and change.median_s is not None
                    assert change.seconds - change.median_s >= MIN_EXCESS_S
                else:
                    assert named.get(rank)
                named[rank] = change.kind == "straggler"
            assert set(watch.stragglers) == {r for r, on in named.items() if on}


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.integers(0, 64), st.just(0.07), max_size=16), st.integers(1, 100))
def test_equal_forward_times_never_make_a_straggler(forward: dict[int, float], ticks: int) -> None:
    assert run(StragglerWatch(), forward, ticks * TICK) == []


# -- the timer ---------------------------------------------------------------------------------


def reporting(watch: ProgressWatch, forward_us: dict[int, int]) -> None:
    for rank, micros in forward_us.items():
        health = RankHealth(rank, rank, 1000 + rank, attached_at=0.0)
        report = ProgressReport(steps=5, entered=10, called=0, returned=0, fwd_us=micros)
        watch.observe(health, rank, report, 0.0)


def tick_until_named(timer: StragglerTimer, events: EventLog) -> float:
    """Tick once a second until the timer names a straggler; when it did."""
    now = 0.0
    while not events.since():
        now += 1.0
        timer.tick(now, WALL + now)
        assert now <= SUSTAIN_S + 2
    return now


def test_the_timer_emits_events_publishes_changes_and_shows_the_straggler_in_status() -> None:
    progress, events, published = ProgressWatch(), EventLog(None), []
    timer = StragglerTimer(progress, events, "a", share=None, publish=lambda: published.append(1))
    reporting(progress, {0: 2000, 1: 62000})
    assert timer.summary()["forward"] == (
        {"global_rank": 0, "forward_us": 2000},
        {"global_rank": 1, "forward_us": 62000},
    )
    now = tick_until_named(timer, events)
    [event] = events.since()
    assert event.kind == "straggler"
    assert event.data["global_rank"] == 1 and event.data["ratio"] == 31.0
    assert event.data["node_id"] == "a" and event.data["since"] == WALL + 1.0
    assert len(published) == 2  # the forward times at first, the straggler
    timer.tick(now + 1, WALL)
    assert len(published) == 2  # nothing moved
    assert timer.summary()["stragglers"] == (
        {"global_rank": 1, "ratio": 31.0, "since": WALL + 1.0, "signal": "forward"},
    )
    summary = {"node_id": "a", "state": "running", "attempt": 0, "restart_count": 0}
    summary |= {"group_rank": 0, "nproc_per_node": 2, "time": WALL, **timer.summary()}
    record = NodeSummary.model_validate(summary)  # as the coordinator publishes it
    assert record.stragglers[0].global_rank == 1 and len(record.forward) == 2
    rank1 = RankHealth(1, 1, 1001, attached_at=0.0)
    reporting(progress, {1: 62000})
    view = progress.view(progress._ranks[1].rank, now)
    assert view is not None
    assert view["straggler"] == {"ratio": 31.0, "since": WALL + 1.0, "signal": "forward"}
    assert progress.view(rank1, now) is None  # not the rank that reported
    reporting(progress, {1: 80000})  # moved: published again once PUBLISH_S passed
    timer.tick(now + 2, WALL)
    assert len(published) == 2
    timer.tick(now + PUBLISH_S + 1, WALL)
    assert len(published) == 3


def test_peer_forward_takes_the_other_nodes_ranks_and_skips_garbage() -> None:
    cluster: dict[str, Any] = {
        "nodes": [
            {"node_id": "a", "forward": [{"global_rank": 0, "forward_us": 10}]},
            {"node_id": "b", "forward": [{"global_rank": 1, "forward_us": 62000}, "x", {}]},
            {"node_id": "c", "forward": [{"global_rank": True, "forward_us": 1}]},
            {"node_id": "d", "forward": [{"global_rank": 2, "forward_us": -1}]},
            {"node_id": "e", "state": "unknown"},
            "garbage",
        ]
    }
    assert peer_forward(cluster, "a") == {1: 0.062}
    assert peer_forward({"nodes": "x"}, "a") == {}


def test_moved_means_a_new_rank_or_a_change_over_five_percent() -> None:
    assert not moved({0: 0.1}, {0: 0.104})
    assert moved({0: 0.1}, {0: 0.106})
    assert moved({0: 0.1}, {0: 0.1, 1: 0.1})


def test_a_rank_slow_between_steps_is_a_straggler_by_its_host_time() -> None:
    """Data loading 80 ms longer on rank 1: equal forward times, its host time tells."""
    progress, events = ProgressWatch(), EventLog(None)
    timer = StragglerTimer(progress, events, "a")
    for rank, host_us in {0: 1500, 1: 81500}.items():
        health = RankHealth(rank, rank, 1000 + rank, attached_at=0.0)
        report = ProgressReport(steps=5, called=0, returned=0, fwd_us=9000, host_us=host_us)
        progress.observe(health, rank, report, 0.0)
    assert timer.summary()["forward"] == (
        {"global_rank": 0, "forward_us": 9000, "host_us": 1500},
        {"global_rank": 1, "forward_us": 9000, "host_us": 81500},
    )
    now = tick_until_named(timer, events)
    [event] = events.since()
    assert event.data["signal"] == "host" and event.data["global_rank"] == 1, event.data
    assert event.data["host_s"] == 0.0815 and event.data["median_s"] == 0.0015, event.data
    assert (
        "time between steps outside its forward (data loading, host work) is 81.5 ms"
        in (event.data["reason"])
    )
    view = progress.view(progress._ranks[1].rank, now)
    assert view is not None and view["host_s"] == 0.0815
    assert view["straggler"] == {"ratio": 54.333, "since": WALL + 1.0, "signal": "host"}
    assert timer.summary()["stragglers"][0]["signal"] == "host"


def test_peer_times_read_both_signals_and_bound_the_ranks_read() -> None:
    cluster: dict[str, Any] = {
        "nodes": [
            {"node_id": "b", "forward": [{"global_rank": 1, "forward_us": 10, "host_us": 20}]},
            {"node_id": "c", "forward": [{"global_rank": 2, "host_us": 7}, {"host_us": 1}]},
        ]
    }
    assert peer_times(cluster, "a") == {"forward": {1: 1e-5}, "host": {1: 2e-5, 2: 7e-6}}
    flood = {"nodes": [{"node_id": "b", "forward": [{"global_rank": 1}] * (MAX_PEER_RANKS + 9)}]}
    assert peer_times(flood, "a") == {"forward": {}, "host": {}}
