"""Rank assignment: which members of a round call the function, and with which rank.

NVRx's names and rules (`inprocess.rank_assignment`), our code. Under ftd the daemon decides
a round's members; a Wrapper given `rank_assignment` then applies it on every member to the
same input, so every rank agrees without talking: the state of the initial layout (`rank` =
the initial rank, `world_size` = the initial world size) and, as `terminated_ranks`, the
initial ranks that are not members of this round. (NVRx applies it to the previous round's
assignment; from the initial layout the result is the same after one loss, and a respawned
process, which knows no history, computes what the others do.)

Active ranks call the function with RANK = `active_rank` and WORLD_SIZE =
`active_world_size`; inactive ones wait, as reserves, for the round to end (a fault, where
they may become active, or every active rank returning); a rank the assignment discards
raises RankDiscarded, and its process exits.

The hierarchical assignment (Tree, Layer, LayerFlag) lives in rank_tree.py and
rank_tree_placement.py and is exposed here, as in NVRx.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from ftd_client.inprocess.exceptions import RestartError
from ftd_client.inprocess.rank_assignment_base import RankAssignment as RankAssignment
from ftd_client.inprocess.rank_assignment_base import RankAssignmentCtx as RankAssignmentCtx
from ftd_client.inprocess.rank_assignment_base import RankDiscarded as RankDiscarded
from ftd_client.inprocess.state import FrozenState, Mode


class RankFilter(RankAssignment):
    """A RankAssignment that only chooses which ranks are active (after any renumbering)."""


def _replace(ctx: RankAssignmentCtx, **changes: Any) -> RankAssignmentCtx:
    ctx.state = dataclasses.replace(ctx.state, **changes)
    return ctx


class ActivateAllRanks(RankFilter):
    """Every rank is active."""

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state = ctx.state
        return _replace(
            ctx, mode=Mode.ACTIVE, active_rank=state.rank, active_world_size=state.world_size
        )


class ShiftRanks(RankAssignment):
    """Healthy ranks keep their order and close the gaps: `| 0 | X | 2 | 3 |` -> `0 1 2`."""

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        rank, gone = ctx.state.rank, ctx.terminated_ranks
        if rank in gone:
            raise RankDiscarded(f"rank={rank} terminated_ranks={sorted(gone)}")
        shifted = rank - sum(rank > other for other in gone)
        ctx = _replace(ctx, rank=shifted, world_size=ctx.state.world_size - len(gone))
        ctx.terminated_ranks = set()
        return ctx


class FillGaps(RankAssignment):
    """The first ranks keep their index; the highest healthy ranks move into the gaps:
    `| 0 | X | 2 | 3 | X | X | 6 | 7 |` -> `| 0 | 6 | 2 | 3 | 7 |`."""

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        rank, gone = ctx.state.rank, ctx.terminated_ranks
        if rank in gone:
            raise RankDiscarded(f"rank={rank} terminated_ranks={sorted(gone)}")
        world_size = ctx.state.world_size - len(gone)
        if rank >= world_size:
            # The k-th healthy rank past the new end takes the k-th gap below it.
            movers = [r for r in range(world_size, ctx.state.world_size) if r not in gone]
            gaps = sorted(r for r in gone if r < world_size)
            rank = gaps[movers.index(rank)]
        ctx = _replace(ctx, rank=rank, world_size=world_size)
        ctx.terminated_ranks = set()
        return ctx


def _active_world_size(state: FrozenState) -> int:
    if state.active_world_size is None:
        return state.world_size
    return min(state.active_world_size, state.world_size)


def _activate_below(ctx: RankAssignmentCtx, active_world_size: int) -> RankAssignmentCtx:
    active = ctx.state.rank < active_world_size
    return _replace(
        ctx,
        mode=Mode.ACTIVE if active else Mode.INACTIVE,
        active_rank=ctx.state.rank if active else None,
        active_world_size=active_world_size,
    )


class MaxActiveWorldSize(RankFilter):
    """At most `max_active_world_size` active ranks (None: no limit): ranks below it are
    active, the others wait as reserves."""

    def __init__(self, max_active_world_size: int | None = None) -> None:
        self.max_active_world_size = max_active_world_size

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        size = _active_world_size(ctx.state)
        if self.max_active_world_size is not None:
            size = min(size, self.max_active_world_size)
        return _activate_below(ctx, size)


class ActiveWorldSizeDivisibleBy(RankFilter):
    """The active world size rounded down to a multiple of `divisor`."""

    def __init__(self, divisor: int = 1) -> None:
        if divisor < 1:
            raise ValueError(f"divisor must be at least 1, got {divisor}")
        self.divisor = divisor

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        size = _active_world_size(ctx.state) // self.divisor * self.divisor
        return _activate_below(ctx, size)


class FilterCountGroupedByKey(RankAssignment):
    """Groups the healthy ranks by a key (a string, or a function of the state: the host
    name, say) and marks every rank of a group whose count fails `condition` as terminated;
    a following ShiftRanks or FillGaps discards them. Counts through the round's store."""

    _instances = itertools.count()

    def __init__(
        self,
        key_or_fn: str | Callable[[FrozenState], str],
        condition: Callable[[int], bool],
        timeout: timedelta = timedelta(seconds=60),
    ) -> None:
        self.key_or_fn = key_or_fn
        self.condition = condition
        self.timeout = timeout
        self.name = f"{type(self).__name__}_{next(self._instances)}"

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state, store, gone = ctx.state, ctx.store, ctx.terminated_ranks
        if state.rank in gone:
            return ctx
        if store is None:
            raise RestartError(f"{self.name} needs the round's store")
        alive = state.world_size - len(gone)
        prefix = f"ftd_filter/{self.name}/{state.iteration}"
        key = self.key_or_fn(state) if callable(self.key_or_fn) else self.key_or_fn
        store.add(f"{prefix}/count/{key}", 1)
        self._barrier(store, f"{prefix}/counted", alive)
        if not self.condition(int(store.get(f"{prefix}/count/{key}"))):
            store.append(f"{prefix}/drop", f"{state.rank},")
        self._barrier(store, f"{prefix}/submitted", alive)
        dropped = set()
        if store.check([f"{prefix}/drop"]):
            raw = store.get(f"{prefix}/drop").decode().rstrip(",")
            dropped = {int(rank) for rank in raw.split(",") if rank}
        ctx.terminated_ranks = gone | dropped
        return ctx

    def _barrier(self, store: Any, key: str, count: int) -> None:
        """Every alive rank has added to `key`: the last one sets `key/done`, all wait on it."""
        if int(store.add(key, 1)) >= count:
            store.set(f"{key}/done", "1")
        store.wait([f"{key}/done"], self.timeout)


def assign(
    assignment: Callable[[RankAssignmentCtx], RankAssignmentCtx],
    state: FrozenState,
    members: Sequence[int],
    store: Any,
) -> FrozenState:
    """Apply `assignment` to a round (see the module's docstring): `state` carries the
    initial layout and the round's iteration; `members` are the round's initial ranks."""
    initial = dataclasses.replace(
        state,
        rank=state.initial_rank,
        world_size=state.initial_world_size,
        active_rank=None,
        active_world_size=None,
        mode=Mode.INITIALIZED,
    )
    gone = set(range(state.initial_world_size)) - set(members)
    ctx = assignment(RankAssignmentCtx(initial, store, gone))
    result = ctx.state
    if result.rank in ctx.terminated_ranks:
        raise RankDiscarded(f"rank={result.rank} terminated_ranks={sorted(ctx.terminated_ranks)}")
    if result.mode is Mode.INITIALIZED:  # no filter ran: every rank is active
        result = dataclasses.replace(
            result, mode=Mode.ACTIVE, active_rank=result.rank, active_world_size=result.world_size
        )
    return result


# NVRx exposes the hierarchical assignment in this module; it lives in modules of its own.
from ftd_client.inprocess.rank_tree import Tree as Tree  # noqa: E402
from ftd_client.inprocess.rank_tree_placement import Layer as Layer  # noqa: E402
from ftd_client.inprocess.rank_tree_placement import LayerFlag as LayerFlag  # noqa: E402
from ftd_client.inprocess.rank_tree_placement import Node as Node  # noqa: E402
from ftd_client.inprocess.rank_tree_placement import Placement as Placement  # noqa: E402
from ftd_client.inprocess.rank_tree_placement import (  # noqa: E402
    bounded_activate as bounded_activate,
)
from ftd_client.inprocess.rank_tree_placement import (  # noqa: E402
    propagate_terminations as propagate_terminations,
)
