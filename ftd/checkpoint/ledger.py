"""Which slot each rank's next snapshot goes in, and which snapshot a restart restores. Pure.

Every rank has SLOTS slots in the node's memory. A restart must find one step whose snapshot is
complete on every rank (all ranks resume at the same step), while no rank ever waits for
another to finish its copy. So a rank may overwrite a slot only when the snapshot in it can
no longer be that step:
- it is not complete (a write given up, or cut short by the rank's death);
- it is older than the newest step complete on every rank (the common step);
- it is a step some other rank will never hold (it holds no such snapshot and has begun a later
  one, or was refused that one);
- or the rank's history went back (its step is at or after the one now begun: the job restarted
  its count, or redoes steps after a restore). Such a snapshot stops counting as complete the
  moment the earlier step is begun: where many are kept, one left beside the new history would
  be restored beside the peers' new snapshots of its step.
The common step is never overwritten by those rules, and a step newer than it that may still
become common is kept too; when both slots are kept, the save is refused as `busy` (skipped: the
next one goes in once the peers' copies are done). With two slots a rank therefore holds at most
the common snapshot and the one being written, as the memory bound promises.

A job of several nodes (`agreement`): no daemon sees every rank, so none can tell the common
step; the ranks agree on it when they restore (ftd_client/checkpoint/_agree.py), and each rank
keeps its newest two complete snapshots plus the one being written (AGREEMENT_SLOTS). Why
three: ranks meet in collectives every step, so when a rank begins step S+1 every peer has
completed S-1 and begun S, whose copy may still run; a rank that kept only S and S+1 would
leave no step complete everywhere should the job fail in that moment. Saves are never refused
as busy then.

With replicas on a peer node (replication.py), the survivors of a lost node must still hold a
step that the lost node's replica holds. Each node says which steps its successor acknowledged
for all its ranks (the newest ones), and the successor keeps its newest three replicas of each
rank (those two, and one whose acknowledgement may be on its way). Every node keeps, besides its
newest two, every complete snapshot from `keep_from` on: the oldest of the other nodes'
second-newest acknowledged steps (`replica_floor`), as this daemon last read them (a stale view
is older, so it keeps more; a node that has not said two: everything stays). Why the
second-newest: when a node's step S is acknowledged, its peers may not have completed S yet,
but they have completed S-1, and so the step before S that node replicated. Over the budget
(or MAX_SLOTS) the save is refused as busy (tests/checkpoint/test_replica_ledger.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from ftd_client.protocol import MAX_SLOTS

SLOTS = 2
AGREEMENT_SLOTS = 3


@dataclass
class Slot:
    step: int
    world: int
    reserved: int
    complete: bool = False
    sending: bool = False
    """Being copied to the peer that keeps its replica: not overwritten until that ends."""


@dataclass
class RankSlots:
    slots: list[Slot | None] = field(default_factory=lambda: [None] * SLOTS)
    newest_seen: int = -1
    """The newest step this rank began or was refused: it will never hold an older step it
    does not hold now (until its history goes back)."""

    def holds(self, step: int, world: int) -> bool:
        return any(s is not None and s.step == step and s.world == world for s in self.slots)

    def complete_steps(self, world: int) -> list[int]:
        return sorted(s.step for s in self.slots if s and s.complete and s.world == world)

    def complete(self, step: int, world: int) -> int | None:
        for index, s in enumerate(self.slots):
            if s is not None and s.complete and s.step == step and s.world == world:
                return index
        return None


def replica_floor(others: Sequence[Sequence[int]]) -> int | None:
    """`keep_from`, from the other nodes' acknowledged steps (each list oldest first): the oldest
    of their second-newest ones; None (keep everything) while one has fewer than two."""
    if any(len(steps) < 2 for steps in others):
        return None
    return min((sorted(steps)[-2] for steps in others), default=None)


class Grant(NamedTuple):
    slot: int


class Refusal(NamedTuple):
    reason: Literal["busy", "too_large"]
    detail: str


class Ledger:
    def __init__(self, budget_bytes: int, agreement: bool = False) -> None:
        self.budget_bytes = budget_bytes
        self.agreement = agreement
        self.slot_count = AGREEMENT_SLOTS if agreement else SLOTS
        self._ranks: dict[int, RankSlots] = {}
        self.pinned = False
        """Replicas are kept on a peer: complete snapshots at `keep_from` or later stay."""
        self.keep_from: int | None = None
        self.replica_bytes = 0
        """The peers' replicas held in the same memory, counted against the same budget."""
        self.pinned_busy = 0
        """Saves refused because the snapshots kept for the replicas' sake fill the budget."""

    @property
    def reserved_bytes(self) -> int:
        return sum(s.reserved for r in self._ranks.values() for s in r.slots if s is not None)

    def hold_replicas(self, nbytes: int) -> None:
        """The peers' replicas now take `nbytes` of the same memory (replica_store.py)."""
        self.replica_bytes = nbytes

    def keep_replicated(self, pinned: bool, keep_from: int | None = None) -> None:
        """Replicas are kept on a peer (`pinned`): complete snapshots from `keep_from` on stay
        (None: every one), the replication's word on what its peers acknowledged."""
        self.pinned, self.keep_from = pinned, keep_from

    def keeps(self, step: int) -> bool:
        """Whether a complete snapshot of `step` stays for the replicas' sake."""
        return self.pinned and (self.keep_from is None or step >= self.keep_from)

    def ranks(self) -> dict[int, RankSlots]:
        return self._ranks

    def begin(self, rank: int, step: int, nbytes: int, world: int) -> Grant | Refusal:
        slots = self._ranks.setdefault(rank, RankSlots([None] * self.slot_count))
        slots.newest_seen = step  # granted or refused, it will hold no older step it lacks
        for held in slots.slots:  # the rank went back: what it held from `step` on is another
            if held is not None and held.step >= step and held.world == world:  # history
                held.complete = False  # (never restored beside this one's steps)
        common = None if self.agreement else self.common_step(world)
        newest_two = set(slots.complete_steps(world)[-2:])
        free = [
            i
            for i, held in enumerate(slots.slots)
            if self._overwritable(held, step, world, common, newest_two)
        ]
        if not free and self.pinned:  # one more slot, if the budget has room for it
            full = len(slots.slots) >= MAX_SLOTS
            if full or self.reserved_bytes + self.replica_bytes + nbytes > self.budget_bytes:
                self.pinned_busy += 1
                return Refusal(
                    "busy",
                    f"the snapshots kept until the peers' replicas hold a newer step fill "
                    f"--checkpoint-memory {self.budget_bytes} or {MAX_SLOTS} slots "
                    f"(replicated by every node: step {self.keep_from})",
                )
            slots.slots.append(None)
            free = [len(slots.slots) - 1]
        if not free:
            return Refusal("busy", f"every slot holds a snapshot that may be restored ({common=})")
        index = min(free, key=lambda i: _preference(slots.slots[i], step, world))
        others = self.reserved_bytes - sum(s.reserved for s in [slots.slots[index]] if s)
        others += self.replica_bytes
        if others + nbytes > self.budget_bytes:
            return Refusal(
                "too_large",
                f"a snapshot of {nbytes} bytes does not fit --checkpoint-memory "
                f"{self.budget_bytes}: {others} bytes are held by the other snapshots",
            )
        slots.slots[index] = Slot(step, world, nbytes)
        return Grant(index)

    def writing(self, rank: int, slot: int, step: int) -> Slot | None:
        """The slot granted for `step` and not yet complete (mark it `complete` once it is)."""
        slots = self._ranks.get(rank)
        held = slots.slots[slot] if slots is not None and 0 <= slot < len(slots.slots) else None
        return None if held is None or held.step != step or held.complete else held

    def common_step(self, world: int) -> int | None:
        """The newest step complete on every rank of a job of `world` ranks."""
        if any(rank not in self._ranks for rank in range(world)):
            return None
        candidates = {
            s.step
            for s in self._ranks[0].slots
            if s is not None and s.complete and s.world == world
        }
        common = [
            step
            for step in candidates
            if all(self._ranks[r].complete(step, world) is not None for r in range(world))
        ]
        return max(common, default=None)

    def newest_seen(self, world: int) -> int | None:
        """The newest step any rank of the job began (or was refused): the job's last step."""
        return max((r.newest_seen for n, r in self._ranks.items() if n < world), default=None)

    def restore(self, rank: int, world: int, step: int | None = None) -> tuple[int, int] | None:
        """(step, slot) of `rank`'s snapshot at the common step (at `step`, the one the ranks
        agreed on), or None when there is none."""
        step = self.common_step(world) if step is None else step
        if step is None or rank not in self._ranks:
            return None
        slot = self._ranks[rank].complete(step, world)
        return None if slot is None else (step, slot)

    def _overwritable(
        self, slot: Slot | None, step: int, world: int, common: int | None, newest_two: set[int]
    ) -> bool:
        if slot is not None and slot.sending:
            return False
        if slot is None or not slot.complete or slot.step >= step or slot.world != world:
            return True
        if self.agreement:  # no daemon sees every rank: the rank's newest two complete stay
            return slot.step not in newest_two and not self.keeps(slot.step)
        if common is not None and slot.step < common:
            return True
        return self._impossible(slot.step, world)

    def _impossible(self, step: int, world: int) -> bool:
        return any(
            r.newest_seen >= step and not r.holds(step, world)
            for rank, r in self._ranks.items()
            if rank < world
        )


def _preference(slot: Slot | None, step: int, world: int) -> tuple[int, int]:
    if slot is None or not slot.complete:
        return (0, 0)
    if slot.step >= step or slot.world != world:
        return (1, 0)
    return (2, slot.step)
