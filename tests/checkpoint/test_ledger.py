"""The ledger's promise (ftd/checkpoint/ledger.py), for any order in which ranks begin, finish
and abandon their snapshots: once a step is complete on every rank, some step stays complete on
every rank, never an older one than before, and every rank can restore it; no rank holds more
than two snapshots; in a job whose ranks meet every step, no save is skipped."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ftd.checkpoint.ledger import SLOTS, Grant, Ledger, RankSlots, Refusal

MiB = 1 << 20

actions = st.lists(
    st.tuples(st.sampled_from(["begin", "done", "abandon"]), st.integers(0, 3), st.integers(1, 3)),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), actions)
def test_a_step_complete_on_every_rank_is_never_lost(
    world: int, script: list[tuple[str, int, int]]
) -> None:
    ledger = Ledger(budget_bytes=1 << 40)
    next_step = dict.fromkeys(range(world), 0)
    writing: dict[int, tuple[int, int]] = {}  # rank -> (slot, step) granted, not yet done
    newest_common: int | None = None
    for action, rank, advance in script:
        rank %= world
        if action == "begin":
            next_step[rank] += advance
            writing.pop(rank, None)  # one save at a time: an older write is given up
            decision = ledger.begin(rank, next_step[rank], MiB, world)
            if isinstance(decision, Grant):
                writing[rank] = (decision.slot, next_step[rank])
        elif action == "done" and rank in writing:
            slot, step = writing.pop(rank)
            held = ledger.writing(rank, slot, step)
            assert held is not None
            held.complete = True
        elif action == "abandon":
            writing.pop(rank, None)  # the rank died mid-copy
        common = ledger.common_step(world)
        if newest_common is not None:
            assert common is not None and common >= newest_common
        newest_common = common
        for r in range(world):
            assert len(ledger.ranks().get(r, _Empty).slots) <= SLOTS
            if common is not None:
                assert ledger.restore(r, world) is not None
                assert ledger.restore(r, world)[0] == common  # type: ignore[index]


class _Empty:
    slots: list[object] = []


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 30), st.randoms(use_true_random=False))
def test_ranks_that_meet_every_step_skip_no_save(world: int, steps: int, order: object) -> None:
    """DDP: rank r saves step S after the optimizer's step S, which followed every rank's
    gradients of S, which followed every rank's optimizer step S-1, before which its own copy of
    S-1 was done. So each rank's save of S may come before or after any peer's copy of S-1 ends,
    but by the rank's optimizer step S+1 all of them have ended: a refused save asks again then."""
    import random

    assert isinstance(order, random.Random)
    ledger = Ledger(budget_bytes=1 << 40)
    writing: dict[int, tuple[int, int]] = {}
    for step in range(1, steps + 1):
        events = [("begin", r) for r in range(world)] + [("done", r) for r in writing]
        order.shuffle(events)
        refused = []
        for kind, rank in events:
            if kind == "done":
                slot, at = writing.pop(rank)
                held = ledger.writing(rank, slot, at)
                assert held is not None
                held.complete = True
            else:
                decision = ledger.begin(rank, step, MiB, world)
                if isinstance(decision, Refusal):
                    refused.append(rank)
                else:
                    writing[rank] = (decision.slot, step)
        for rank in writing.copy():  # the copies of step S end before each optimizer step S+1
            slot, at = writing.pop(rank)
            held = ledger.writing(rank, slot, at)
            assert held is not None
            held.complete = True
        for rank in refused:  # asked again in the optimizer's pre-step hook
            decision = ledger.begin(rank, step, MiB, world)
            assert isinstance(decision, Grant), decision
            held = ledger.writing(rank, decision.slot, step)
            assert held is not None
            held.complete = True
    assert ledger.common_step(world) == steps


def test_a_snapshot_that_cannot_fit_is_refused_with_the_figures() -> None:
    ledger = Ledger(budget_bytes=10 * MiB)
    for rank in (0, 1):
        grant = ledger.begin(rank, 1, 4 * MiB, 2)
        assert isinstance(grant, Grant)
        ledger.writing(rank, grant.slot, 1).complete = True  # type: ignore[union-attr]
    refusal = ledger.begin(0, 2, 4 * MiB, 2)
    assert isinstance(refusal, Refusal) and refusal.reason == "too_large"
    assert "4194304 bytes" in refusal.detail and "--checkpoint-memory 10485760" in refusal.detail
    assert ledger.reserved_bytes == 8 * MiB  # what was held stays held


def test_a_rank_that_goes_back_overwrites_its_future() -> None:
    """After a restore at step 5 the ranks redo 6: the 6 a rank held before is no snapshot to
    keep (not complete everywhere, or it would have been restored)."""
    ledger = Ledger(budget_bytes=1 << 30)
    for step in (5, 6):
        for rank in (0, 1):
            if rank == 1 and step == 6:
                continue  # rank 1 died before its copy of 6
            grant = ledger.begin(rank, step, MiB, 2)
            assert isinstance(grant, Grant)
            held = ledger.writing(rank, grant.slot, step)
            assert held is not None
            held.complete = True
    assert ledger.restore(0, 2) is not None and ledger.common_step(2) == 5
    grant = ledger.begin(0, 6, MiB, 2)
    assert isinstance(grant, Grant)
    assert ledger.common_step(2) == 5  # 5 is kept
    assert ledger.ranks()[0].slots[grant.slot].step == 6  # type: ignore[union-attr]


def test_a_job_of_another_size_restores_nothing() -> None:
    ledger = Ledger(budget_bytes=1 << 30)
    grant = ledger.begin(0, 3, MiB, 1)
    assert isinstance(grant, Grant)
    held = ledger.writing(0, grant.slot, 3)
    assert held is not None
    held.complete = True
    assert ledger.restore(0, 1) == (3, grant.slot)
    assert ledger.restore(0, 2) is None


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 4), st.integers(1, 25), st.randoms(use_true_random=False))
def test_nodes_that_cannot_see_each_other_keep_a_step_every_rank_holds(
    world: int, steps: int, order: object
) -> None:
    """A job of several nodes: each rank on a ledger of its own (no daemon sees another's ranks),
    three slots, the DDP order of the test above (a rank's save of S may come before or after a
    peer's copy of S-1 ends). After every event, the steps complete on every rank (what the
    ranks agree on at a restore) hold a step once one did, never an older one than before; and
    no save is refused."""
    import random

    assert isinstance(order, random.Random)
    ledgers = [Ledger(budget_bytes=1 << 40, agreement=True) for _ in range(world)]
    writing: dict[int, tuple[int, int]] = {}
    newest: int | None = None

    def check() -> None:
        nonlocal newest
        held = [
            set(ledgers[r].ranks().get(r, RankSlots()).complete_steps(world)) for r in range(world)
        ]
        common = max(set.intersection(*held), default=None)
        if newest is not None:
            assert common is not None and common >= newest, (held, newest)
        newest = common

    def finish(rank: int) -> None:
        slot, at = writing.pop(rank)
        held = ledgers[rank].writing(rank, slot, at)
        assert held is not None
        held.complete = True
        check()

    for step in range(1, steps + 1):
        # Each rank: its copy of S-1 ends (pre-step hook), then it begins S; ranks interleave.
        pending = {r: [("done", r)] * (r in writing) + [("begin", r)] for r in range(world)}
        while pending:
            rank = order.choice(sorted(pending))
            kind, _ = pending[rank].pop(0)
            if not pending[rank]:
                del pending[rank]
            if kind == "done":
                finish(rank)
            else:
                decision = ledgers[rank].begin(rank, step, MiB, world)
                assert isinstance(decision, Grant), decision
                writing[rank] = (decision.slot, step)
                check()
