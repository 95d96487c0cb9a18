"""The replicas' keeping rule (ledger.replica_floor and keep_from, replica_store.kept_steps), on
pure ledgers, for any interleaving of a DDP job's saves and copies, of the pushes to the next
node and their acknowledgements, and of each node's stale reads of what the others replicated:
once a node's successor acknowledged two of its steps, whenever that node is lost, one step is
complete on every survivor and held by its replica.

Two simpler rules fail here: keeping everything from the oldest of the nodes' newest replicated
steps (a node whose pushes skipped steps holds replicas of none its peers kept), and from the
newest step every node replicated (nodes whose pushes skipped differently share none: every
snapshot is kept until the memory is full)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from ftd.checkpoint.ledger import Grant, Ledger, RankSlots, replica_floor
from ftd.checkpoint.replica_store import kept_steps

MiB = 1 << 20


class Node:
    """One node of one rank (its global rank is its index): its ledger, the replicas it holds
    of its predecessor's rank, what its successor acknowledged, and what it last read of the
    others' acknowledgements."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank = rank
        self.ledger = Ledger(1 << 40, agreement=True)
        self.ledger.pinned = True
        self.replicas: set[int] = set()
        self.acked: list[int] = []
        self.seen: list[list[int]] = [[] for _ in range(world)]
        self.writing: tuple[int, int] | None = None
        self.pushing: int | None = None

    def complete(self) -> set[int]:
        world = len(self.seen)
        return set(self.ledger.ranks().get(self.rank, RankSlots()).complete_steps(world))

    def read(self, nodes: list[Node]) -> None:
        """A look at the published summaries (each node's acknowledged steps, as they are now)."""
        self.seen = [list(n.acked) for n in nodes]
        self.ledger.keep_from = replica_floor(
            [s for r, s in enumerate(self.seen) if r != self.rank]
        )


def check(nodes: list[Node]) -> None:
    world = len(nodes)
    for lost in (n.rank for n in nodes if len(n.acked) >= 2):
        holder = nodes[(lost + 1) % world]
        survivors = [n.complete() for n in nodes if n.rank != lost]
        common = set.intersection(*survivors) & holder.replicas
        assert common, (lost, survivors, holder.replicas, [n.acked for n in nodes])


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 4), st.integers(1, 20), st.randoms(use_true_random=False))
def test_a_step_survives_any_one_node_s_loss_once_every_node_replicated_one(
    world: int, steps: int, order: random.Random
) -> None:
    nodes = [Node(r, world) for r in range(world)]

    def side_events() -> None:
        """Pushes, acknowledgements and reads, interleaved at random with the saves."""
        for _ in range(order.randint(0, 6)):
            node = order.choice(nodes)
            kind = order.choice(["push", "ack", "read"])
            if kind == "push" and node.pushing is None:
                newest = max(node.complete(), default=None)
                if newest is not None and (not node.acked or newest > node.acked[-1]):
                    index = node.ledger.ranks()[node.rank].complete(newest, world)
                    slot = node.ledger.ranks()[node.rank].slots[index]  # type: ignore[index]
                    assert slot is not None
                    slot.sending = True
                    node.pushing = newest
            elif kind == "ack" and node.pushing is not None:
                successor = nodes[(node.rank + 1) % world]
                successor.replicas = kept_steps({*successor.replicas, node.pushing})
                node.acked = [*node.acked, node.pushing][-16:]
                for slot in node.ledger.ranks()[node.rank].slots:
                    if slot is not None:
                        slot.sending = False
                node.pushing = None
            elif kind == "read":
                node.read(nodes)
            check(nodes)

    for step in range(1, steps + 1):
        pending = {n.rank: ["done"] * (n.writing is not None) + ["begin"] for n in nodes}
        while pending:
            rank = order.choice(sorted(pending))
            kind = pending[rank].pop(0)
            if not pending[rank]:
                del pending[rank]
            node = nodes[rank]
            if kind == "done":
                assert node.writing is not None
                slot, at = node.writing
                held = node.ledger.writing(rank, slot, at)
                assert held is not None
                held.complete = True
                node.writing = None
            else:
                decision = node.ledger.begin(rank, step, MiB, world)
                assert isinstance(decision, Grant), decision
                node.writing = (decision.slot, step)
            check(nodes)
            side_events()


def save(ledger: Ledger, step: int) -> None:
    grant = ledger.begin(0, step, MiB, 1)
    assert isinstance(grant, Grant)
    held = ledger.writing(0, grant.slot, step)
    assert held is not None
    held.complete = True


def test_without_a_step_every_node_replicated_everything_stays() -> None:
    """Before the peers said what they replicated, nothing complete is overwritten (a step all
    of them replicate later must still be there); once they did, the newest two and those from
    that step on."""
    ledger = Ledger(1 << 40, agreement=True)
    ledger.pinned = True
    for step in range(1, 7):
        save(ledger, step)
    assert ledger.ranks()[0].complete_steps(1) == [1, 2, 3, 4, 5, 6]
    ledger.keep_from = 4
    for step in (7, 8):
        save(ledger, step)
    assert isinstance(ledger.begin(0, 9, MiB, 1), Grant)
    assert ledger.ranks()[0].complete_steps(1) == [4, 5, 6, 7, 8]  # 1, 2, 3 overwritten
    assert len(ledger.ranks()[0].slots) == 6
    assert kept_steps([1, 2, 3, 5, 6]) == {3, 5, 6}
    assert replica_floor([[3, 7, 9], [8, 10]]) == 7 and replica_floor([[3, 7], [8]]) is None
    tight = Ledger(3 * MiB, agreement=True)
    tight.pinned = True
    for step in (1, 2, 3):
        save(tight, step)
    refused = tight.begin(0, 4, MiB, 1)
    assert not isinstance(refused, Grant) and refused.reason == "busy"
    assert "kept until the peers' replicas hold a newer step" in refused.detail
    assert tight.pinned_busy == 1


def test_a_rank_that_went_back_holds_none_of_its_old_history_from_there() -> None:
    """With many slots kept, a rank restored at step 2 that redoes 3 must never have its old 3
    (or 4, 5) restored beside its peers' new ones: from the step it begins again, what it held
    is another history."""
    ledger = Ledger(1 << 40, agreement=True)
    ledger.pinned = True
    for step in range(1, 6):
        save(ledger, step)
    grant = ledger.begin(0, 3, MiB, 1)
    assert isinstance(grant, Grant)
    assert ledger.ranks()[0].complete_steps(1) == [1, 2]
    held = ledger.writing(0, grant.slot, 3)
    assert held is not None
    held.complete = True
    assert ledger.ranks()[0].complete_steps(1) == [1, 2, 3]
    assert ledger.restore(0, 1, 3) == (3, grant.slot)
