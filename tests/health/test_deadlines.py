"""Hang deadlines against their definition: random message sequences on a fake clock.

The reference here computes each rank's deadline from the definitions in the README (initial
heartbeat, heartbeat, section, out-of-section), independently of ftd.health.monitor; the monitor's
first verdict must fall exactly at the earliest of them, and name the rank silent longest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, note, settings
from hypothesis import strategies as st

from ftd.config.ft import RankTimeouts
from ftd.health.links import RankHealth
from ftd.health.monitor import BLAME_WINDOW_MAX_S, Monitor
from ftd.health.verdict import Verdict
from tests.support.clock import FakeClock


@dataclass
class Model:
    """One rank by the definitions, for the reference deadline."""

    connected_at: float
    last_heartbeat: float | None = None
    last_seen: float = 0.0
    sections: dict[str, float] = field(default_factory=dict)
    out_of_section_since: float | None = None

    def deadline(self, t: RankTimeouts) -> float | None:
        candidates: list[float] = []
        if self.last_heartbeat is None:
            if t.initial_rank_heartbeat_timeout is not None:
                candidates.append(self.connected_at + t.initial_rank_heartbeat_timeout)
        elif t.rank_heartbeat_timeout is not None:
            candidates.append(self.last_heartbeat + t.rank_heartbeat_timeout)
        for name, started in self.sections.items():
            limit = t.rank_section_timeouts.get(name)
            if limit is not None:
                candidates.append(started + limit)
        if not self.sections and t.rank_out_of_section_timeout is not None:
            assert self.out_of_section_since is not None
            candidates.append(self.out_of_section_since + t.rank_out_of_section_timeout)
        return min(candidates, default=None)


SECONDS = st.sampled_from([None, 0.25, 0.5, 1.0, 2.0, 3.0, 30.0])
TIMEOUTS = st.builds(
    lambda init, hb, a, b, oos: RankTimeouts(
        initial_rank_heartbeat_timeout=init,
        rank_heartbeat_timeout=hb,
        rank_section_timeouts={"a": a, "b": b},
        rank_out_of_section_timeout=oos,
    ),
    SECONDS,
    SECONDS,
    SECONDS,
    SECONDS,
    SECONDS,
)
RANKS = 3
STEP = st.one_of(
    st.tuples(st.just("wait"), st.sampled_from([0.0, 0.1, 0.3, 0.7, 1.5, 4.0])),
    st.tuples(st.just("hb"), st.integers(0, RANKS - 1)),
    st.tuples(st.just("ss"), st.integers(0, RANKS - 1), st.sampled_from(["a", "b"])),
    st.tuples(st.just("se"), st.integers(0, RANKS - 1), st.sampled_from(["a", "b"])),
    st.tuples(st.just("timeouts"), TIMEOUTS),
)


class Harness:
    def __init__(self, timeouts: RankTimeouts) -> None:
        self.clock = FakeClock()
        self.verdicts: list[Verdict] = []
        self.monitor = Monitor(timeouts, self.verdicts.append, clock=self.clock)
        self.monitor.attach([(r, r, 1000 + r) for r in range(RANKS)])
        self.ranks = [self.monitor.rank_of(1000 + r) for r in range(RANKS)]
        self.models = [Model(connected_at=0.0, out_of_section_since=0.0) for _ in range(RANKS)]
        self.changed_at = 0.0
        """When the timeouts last changed: a deadline they put in the past falls due then."""
        for rank in self.ranks:
            assert rank is not None
            self.monitor.on_hello(rank, None, 0.0)

    def rank(self, index: int) -> RankHealth:
        rank = self.ranks[index]
        assert rank is not None
        return rank

    def earliest(self) -> tuple[float, int] | None:
        found = [
            (max(d, self.changed_at), i)
            for i, model in enumerate(self.models)
            if (d := model.deadline(self.monitor.timeouts)) is not None
        ]
        return min(found, default=None)

    def step(self, op: tuple[object, ...]) -> None:
        kind, t = op[0], self.clock.t
        if kind == "wait":
            assert isinstance(op[1], float)
            self.clock.advance_to(t + op[1])
            return
        if kind == "timeouts":
            assert isinstance(op[1], RankTimeouts)
            self.monitor.set_timeouts(op[1])
            self.changed_at = t
            return
        index = op[1]
        assert isinstance(index, int)
        rank, model = self.rank(index), self.models[index]
        if kind == "hb":
            self.monitor.on_heartbeat(rank, t)
            model.last_heartbeat = model.last_seen = t
        elif kind == "ss":
            name = str(op[2])
            self.monitor.on_section_start(rank, name, t)
            model.sections[name] = model.last_seen = t
            model.out_of_section_since = None
        elif kind == "se":
            name = str(op[2])
            if name not in model.sections:
                return
            self.monitor.on_section_end(rank, name, t)
            del model.sections[name]
            model.last_seen = t
            if not model.sections:
                model.out_of_section_since = t


def check_first_verdict(h: Harness, expected: tuple[float, int]) -> None:
    at, _ = expected
    assert h.verdicts, "no verdict"
    verdict = h.verdicts[0]  # the attempt ends with it; later ones would be ignored
    assert abs(verdict.at - at) < 1e-9, (verdict.at, at)
    judged = {item.rank.local_rank for item in verdict.overdue}
    deadlines = {i: m.deadline(h.monitor.timeouts) for i, m in enumerate(h.models)}
    due = {i for i, d in deadlines.items() if d is not None and max(d, h.changed_at) <= at + 1e-9}
    near = {i for i, d in deadlines.items() if d is not None and d <= at + BLAME_WINDOW_MAX_S}
    assert due <= judged <= near, (due, judged, near)
    silent = min(judged, key=lambda i: (h.models[i].last_seen, i))
    assert verdict.first.rank.local_rank == silent


@settings(max_examples=400, deadline=None)
@given(TIMEOUTS, st.lists(STEP, max_size=40))
def test_verdict_falls_at_the_earliest_deadline(
    timeouts: RankTimeouts, steps: list[tuple[object, ...]]
) -> None:
    note(f"timeouts={timeouts.model_dump()} steps={steps}")
    h = Harness(timeouts)
    for op in steps:
        expected = h.earliest()
        nxt = h.clock.t + (op[1] if op[0] == "wait" else 0.0)  # type: ignore[operator]
        if expected is not None and expected[0] <= nxt:
            h.clock.advance_to(expected[0])
            check_first_verdict(h, expected)
            return
        h.step(op)
        due = h.earliest()
        if due is not None and due[0] <= h.clock.t:  # new timeouts put a deadline in the past
            h.clock.advance_to(h.clock.t)
            check_first_verdict(h, due)
            return
        assert not h.verdicts, (h.verdicts, op)
    expected = h.earliest()
    h.clock.advance_to(h.clock.t + 1000.0)
    if expected is None:
        assert not h.verdicts
    else:
        check_first_verdict(h, expected)


def test_initial_thirty_subsequent_two_is_judged_two_seconds_after_the_last_heartbeat() -> None:
    """The README's own pattern: initial 30 s, subsequent 2 s; beats for 0.5 s, then stops."""
    h = Harness(RankTimeouts(initial_rank_heartbeat_timeout=30, rank_heartbeat_timeout=2))
    for beat in range(6):
        h.clock.advance_to(beat * 0.1)
        for r in range(RANKS):
            h.step(("hb", r))
    h.clock.advance_to(100.0)
    assert h.verdicts and abs(h.verdicts[0].at - 2.5) < 1e-9


def test_the_rank_silent_longest_is_named_first() -> None:
    """Rank 1 hangs after its heartbeat; rank 0 heartbeats too, then opens its step section
    and waits in a collective: both go quiet within a millisecond, rank 1 is to blame."""
    h = Harness(RankTimeouts(rank_heartbeat_timeout=3))
    for step in range(5):
        h.clock.advance_to(step * 0.01)
        for r in range(RANKS):
            h.step(("hb", r))
    h.step(("hb", 0))  # rank 0's heartbeat comes a hair later than rank 1's...
    h.clock.advance_to(0.0405)
    h.step(("hb", 1))
    h.clock.advance_to(0.041)
    h.step(("ss", 0, "a"))  # ...and it then opens its step, waiting on rank 1
    h.step(("ss", 2, "a"))
    h.clock.advance_to(100.0)
    verdict = h.verdicts[0]
    assert verdict.first.rank.local_rank == 1
    assert {item.rank.local_rank for item in verdict.overdue} == {0, 1, 2}


def test_a_stalled_daemon_gives_every_rank_a_fresh_grace_period() -> None:
    h = Harness(RankTimeouts(rank_heartbeat_timeout=2))
    for beat in range(4):
        h.clock.advance_to(beat * 0.5)
        for r in range(RANKS):
            h.step(("hb", r))
    h.clock.stall_to(21.5)  # SIGSTOPped for 20 s: every deadline passed while it slept
    assert not h.verdicts
    assert h.monitor.stalls == 1
    for r in range(RANKS - 1):
        h.step(("hb", r))  # the healthy ranks' queued heartbeats
    h.clock.advance_to(100.0)
    assert len(h.verdicts) == 1
    assert h.verdicts[0].first.rank.local_rank == RANKS - 1
    assert abs(h.verdicts[0].at - 23.5) < 1e-9


def test_queued_heartbeats_are_read_before_a_verdict() -> None:
    h = Harness(RankTimeouts(rank_heartbeat_timeout=1))
    for r in range(RANKS):
        h.step(("hb", r))
    queued = {0: 0.9}  # rank 0 sent at 0.9 s, still unread when its timer fires

    def drain() -> set[int]:
        for index, _sent in list(queued.items()):
            h.monitor.on_heartbeat(h.rank(index), h.clock.now())
            queued.pop(index)
        return set()  # no queue was full

    h.monitor.drain = drain
    h.clock.advance_to(1.0)
    judged = {item.rank.local_rank for item in h.verdicts[0].overdue}
    assert 0 not in judged and judged == {1, 2}


def test_a_rank_that_never_connects_is_judged_by_the_initial_timeout() -> None:
    clock = FakeClock()
    verdicts: list[Verdict] = []
    monitor = Monitor(RankTimeouts(initial_rank_heartbeat_timeout=1.5), verdicts.append, clock)
    monitor.attach([(0, 0, 100), (1, 1, 101)])
    rank0 = monitor.rank_of(100)
    assert rank0 is not None
    clock.advance_to(0.5)
    monitor.on_hello(rank0, None, 0.5)
    monitor.on_heartbeat(rank0, 0.6)
    clock.advance_to(100.0)
    [verdict] = verdicts
    assert verdict.first.rank.local_rank == 1 and verdict.at == 1.5
    assert verdict.first.deadline.kind == "never_connected"


def test_no_timeout_set_means_no_verdict_for_a_silent_rank() -> None:
    clock = FakeClock()
    verdicts: list[Verdict] = []
    monitor = Monitor(RankTimeouts(), verdicts.append, clock)
    monitor.attach([(0, 0, 100)])
    clock.advance_to(1e6)
    assert verdicts == []
