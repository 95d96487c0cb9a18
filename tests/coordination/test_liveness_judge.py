"""The c10d liveness verdict (ftd.coordination.c10d.liveness.judge) with a fake clock: a node
that beats on time is never declared dead whatever the reader's jitter; a node that stopped is
declared dead once, never sooner than the keepalive timeout after its last beat and no later
than two reads after that; a reader whose own reads were late declares no one."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from ftd.coordination.c10d.liveness import BEATS_PER_TIMEOUT, Beat, judge
from ftd.coordination.records import AliveRecord

TIMEOUT_S = 5.0
INTERVAL_S = TIMEOUT_S / BEATS_PER_TIMEOUT


@settings(max_examples=300, deadline=None)
@given(
    jitters=st.lists(st.floats(0, INTERVAL_S / 2), min_size=40, max_size=40),
    beat_jitters=st.lists(st.floats(0, INTERVAL_S / 2), min_size=40, max_size=40),
    stop_after=st.integers(3, 25),
)
@example(jitters=[0.0] * 40, beat_jitters=[0.0] * 40, stop_after=4)
def test_on_time_beats_live_and_a_stopped_node_is_declared_within_two_reads(
    jitters: list[float], beat_jitters: list[float], stop_after: int
) -> None:
    # The reader and both nodes run on the same loaded machine: each is late by its jitter.
    reads = [i * INTERVAL_S + jitter for i, jitter in enumerate(jitters)]
    beats_of = [i * INTERVAL_S + jitter for i, jitter in enumerate(beat_jitters)]
    last_beat = beats_of[stop_after]
    seen = {"alive": Beat(None, 0.0), "stopped": Beat(None, 0.0)}
    last_read: float | None = None
    declared: list[tuple[str, float]] = []
    for now in reads:

        def seq(until: float) -> int:
            return sum(1 for at in beats_of if at <= until)

        beats = {
            "alive": AliveRecord(seq=seq(now), done=False),
            "stopped": AliveRecord(seq=seq(min(now, last_beat)), done=False),
        }
        seen, dead = judge(seen, beats, now, last_read, TIMEOUT_S)
        last_read = now
        declared += [(node, now) for node, _ in dead]
    assert all(node == "stopped" for node, _ in declared), declared
    if reads[-1] > last_beat + TIMEOUT_S + 2 * 1.5 * INTERVAL_S:
        first = next(at for node, at in declared if node == "stopped")
        # The judge's own arithmetic: as a sum, 6.666666666666667 + 5.0 rounds to the very
        # read it judges at (11.666666666666668; found by hypothesis, the example below).
        assert first - last_beat > TIMEOUT_S
        assert first <= last_beat + TIMEOUT_S + 2 * 1.5 * INTERVAL_S


def test_a_reader_that_was_stalled_declares_no_one() -> None:
    seen = {"quiet": Beat(1, 0.0)}
    beats = {"quiet": AliveRecord(seq=1, done=False)}
    late = 2 * TIMEOUT_S  # its last read was this long ago: it cannot tell who was silent
    seen, dead = judge(seen, beats, late, 0.0, TIMEOUT_S)
    assert dead == [] and seen["quiet"].since == late
    # Timed again from that read on: silent for the timeout after it, not before.
    _, dead = judge(seen, beats, late + TIMEOUT_S - 0.1, late + TIMEOUT_S - 0.2, TIMEOUT_S)
    assert dead == []
    _, dead = judge(seen, beats, late + TIMEOUT_S + 0.1, late + TIMEOUT_S, TIMEOUT_S)
    assert [node for node, _ in dead] == ["quiet"]
