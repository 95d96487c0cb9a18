"""The pulls' budgets and retries (ftd/checkpoint/replica_pull.py) as properties: whatever worlds
a node's ranks name in their restores, in whatever order and rounds, at most one pull runs per
(rank, world), only in the round's world, at most MAX_WORLDS per rank in a round, and every
request that starts none is counted; whatever a peer's tries do, one peer is asked at most
ATTEMPTS times, its pauses well within the pull's bound, and a pull that never got an answer is
counted and said (an event), never dropped silently."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftd.checkpoint import replica_pull
from ftd.checkpoint.replica_frame import FrameError
from ftd.checkpoint.replica_pull import (
    ATTEMPTS,
    MAX_WORLDS,
    PULL_TIMEOUT_S,
    Pulls,
    pauses,
)
from ftd.checkpoint.replica_ring import Ring
from ftd.refusals import Refusals
from ftd.status.events import EventLog


async def nothing() -> None:
    pass


def pulls() -> Pulls:
    refused = Refusals("replica")
    return Pulls(b"k" * 32, "c", EventLog(None), Ring(refused), nothing, refused)


requests = st.lists(
    st.tuples(st.integers(0, 3), st.integers(1, 6), st.sampled_from([None, (1, 4), (2, 5)])),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(requests)
def test_one_pull_per_rank_and_world_in_the_round_s_world_and_the_rest_counted(
    asked: list[tuple[int, int, tuple[int, int] | None]],
) -> None:
    async def run() -> None:
        gate = asyncio.Event()  # the pulls stay in flight: the budgets are what is tested
        started: list[tuple[int, int, int | None]] = []
        p = pulls()

        async def pull(rank: int, world: int, *_: object) -> None:
            await gate.wait()

        p._pull = pull  # type: ignore[method-assign]
        round_ = None
        for rank, world, current in asked:
            before = (len(p._tasks), sum(p.refused.values()), set(p._tasks))
            running = p.restoring(rank, world, current, None, None)  # type: ignore[arg-type]
            if current is not None:
                round_ = current[0]
            if set(p._tasks) - before[2]:
                started.append((rank, world, round_))
                assert running
                assert current is None or world == current[1]
                assert rank < world
            elif (rank, world) not in p._tasks:  # neither started nor in flight: counted
                assert sum(p.refused.values()) == before[1] + 1
            per_rank: dict[int, int] = {}
            for r, _ in p._tasks:
                per_rank[r] = per_rank.get(r, 0) + 1
            assert all(count <= MAX_WORLDS for count in per_rank.values())
        assert len(set(started)) == len(started)  # never twice in one round
        gate.set()
        p.close()
        await asyncio.sleep(0)

    asyncio.run(run())


def test_the_pauses_double_and_stay_well_within_the_pull_s_bound() -> None:
    schedule = pauses()
    assert len(schedule) == ATTEMPTS and schedule[0] == 0
    assert all(b == 2 * a for a, b in itertools.pairwise(schedule[1:]))
    assert sum(schedule) < PULL_TIMEOUT_S / 4


failures = st.lists(
    st.sampled_from(["ok", "reset", "eof", "refused_frame"]), min_size=ATTEMPTS, max_size=8
)


@settings(max_examples=100, deadline=None)
@given(failures)
def test_a_peer_is_tried_at_most_attempts_times_and_a_failure_is_never_silent(
    outcomes: list[str],
) -> None:
    async def run() -> None:
        p = pulls()
        p.ring.addresses["a"] = "127.0.0.1:1"
        tries: list[str] = []

        async def fetch(*_: Any) -> list[tuple[int, Any]]:
            outcome = outcomes[len(tries)]
            tries.append(outcome)
            if outcome == "reset":
                raise ConnectionResetError("over the peer's connections")
            if outcome == "eof":
                raise EOFError
            if outcome == "refused_frame":
                raise FrameError("timeout", "no bytes")
            return [(7, Path("/nonexistent"))]

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(replica_pull, "fetch", fetch)
            patch.setattr(replica_pull, "BACKOFF_S", 0.0)
            got = await p._fetch("a", 1, 2, None)  # type: ignore[arg-type]
        assert len(tries) <= ATTEMPTS
        if "ok" in outcomes[:ATTEMPTS]:
            assert tries[-1] == "ok" and got == [(7, Path("/nonexistent"))]
            assert p.refused["pull_failed"] == 0
        else:
            assert len(tries) == ATTEMPTS and got == []
            assert p.refused["pull_failed"] == 1
            (said,) = [e.data for e in p.events.since(0) if e.kind == "replica_pulled"]
            assert said["error"] and said["steps"] == [] and said["source"] == ["a"]

    asyncio.run(run())
