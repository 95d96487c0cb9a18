"""The parts of a rank Tree (rank_tree.py) and NVRx's placement on them: `LayerFlag`, `Layer`,
`Node` (a branch or a leaf), `bounded_activate`, `propagate_terminations` (NVRx's names,
arguments and rules; our code), and `Placer`, what NVRx's Tree keeps between restarts.

A placement, NVRx's algorithm:
1. Activation: the leaves, depth first (groups in the order of their first rank), are active
   while every branch above has fewer active ranks than its layer's max_ranks; the others are
   inactive: reserves.
2. At each restart, with the ranks lost since the last one:
   - termination spreads up: a branch below its min_ranks loses all its ranks (children first);
   - a lost active rank, in rank order, takes the reserve that became inactive last in the
     nearest branch above it that has one, climbing only through RESERVE layers;
   - in a BACKFILL branch, the highest active ranks move into the remaining gaps;
   - the gaps left then close, every active rank above one shifting down (ShiftRanks);
   - `world_size_filter(active world size)`, if given, may lower it: active ranks at or
     above the new size become reserves;
   - `rank` is the position among the healthy leaves, depth first.
"""

from __future__ import annotations

import bisect
import enum
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass

from ftd_client.inprocess.state import FrozenState, Mode

MAX_KEY_CHARS = 1024
"""The longest grouping key (a host name has at most 253 characters)."""


class LayerFlag(enum.Flag):
    """How a lost active rank of a Layer's branch is replaced.

    RESERVE: by an inactive rank of the branch (searched from the nearest branch up, through
        consecutive RESERVE layers);
    BACKFILL: by the highest active rank of the branch (of the highest of the consecutive
        BACKFILL layers above the rank), which moves into the gap.
    """

    RESERVE = enum.auto()
    BACKFILL = enum.auto()


@dataclass
class Layer:
    """One level of a Tree: each of its branches (the ranks with the same key) activates at
    most `max_ranks` ranks (None: no limit) and is terminated below `min_ranks` healthy ones.
    `key_or_fn`: a string, or a function of the rank's FrozenState returning its key."""

    min_ranks: int = 1
    max_ranks: int | None = None
    key_or_fn: str | Callable[[FrozenState], str] = ""
    flag: LayerFlag | None = None

    def __post_init__(self) -> None:
        if not _is_count(self.min_ranks):
            raise ValueError(f"Layer min_ranks must be an int >= 0, got {self.min_ranks!r}")
        if self.max_ranks is not None and not _is_count(self.max_ranks):
            raise ValueError(f"Layer max_ranks must be None or an int >= 0, got {self.max_ranks!r}")
        if not isinstance(self.key_or_fn, str) and not callable(self.key_or_fn):
            raise TypeError(f"Layer key_or_fn must be a str or a callable, got {self.key_or_fn!r}")
        if self.flag is not None and not isinstance(self.flag, LayerFlag):
            raise TypeError(f"Layer flag must be a LayerFlag or None, got {self.flag!r}")

    def key(self, state: FrozenState) -> str:
        """This rank's key at this layer (an int from a function is taken as its digits)."""
        value: object = self.key_or_fn(state) if callable(self.key_or_fn) else self.key_or_fn
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise TypeError(f"Layer key_or_fn must give a str, got {value!r} from {self!r}")
        key = str(value)
        if len(key) > MAX_KEY_CHARS:
            raise ValueError(f"a Layer key has at most {MAX_KEY_CHARS} characters: {key[:40]!r}…")
        return key

    def has(self, flag: LayerFlag) -> bool:
        return self.flag is not None and bool(self.flag & flag)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass
class LeafState:
    """A leaf's part while a placement is computed (NVRx keeps a mutable State there)."""

    initial_rank: int
    rank: int
    mode: Mode = Mode.INITIALIZED
    active_rank: int | None = None


@dataclass(frozen=True)
class Placement:
    """One initial rank's part in a round, as a Tree places it."""

    rank: int
    """Position among the healthy ranks, depth first (a terminated rank: world_size or more)."""
    world_size: int
    mode: Mode
    active_rank: int | None
    active_world_size: int


class Node:
    """A branch of a Tree (`layer` set), or a leaf: one rank (`state` set, no layer).

    `inactive_nodes`: the inactive leaves below, in the order they became inactive (the last
    is the first taken as a reserve); `backfill_domain`, of a leaf: the branch whose active
    ranks may move into its place."""

    def __init__(
        self, parent: Node | None, name: object, layer: Layer | None, state: LeafState | None
    ) -> None:
        self.parent = parent
        self.name = name
        self.layer = layer
        self.state = state
        self.active_count = 0
        self.children: dict[object, Node] = {}
        self.inactive_nodes: dict[int, Node] = {}
        self.backfill_domain: Node | None = None

    def add_child(self, name: object, layer: Layer | None, state: LeafState | None) -> Node:
        child = self.children[name] = Node(self, name, layer, state)
        return child

    def is_leaf(self) -> bool:
        return not self.children

    def iter_leaves(self) -> Iterator[Node]:
        """The leaves below, depth first."""
        if self.is_leaf():
            yield self
        for child in self.children.values():
            yield from child.iter_leaves()

    def ancestors(self) -> Iterator[Node]:
        node = self.parent
        while node is not None:
            yield node
            node = node.parent

    @property
    def leaf(self) -> LeafState:
        if self.state is None:
            raise TypeError(f"{self!r} is a branch, not a leaf")
        return self.state

    def deactivate(self) -> None:
        leaf = self.leaf
        leaf.mode, leaf.active_rank = Mode.INACTIVE, None
        for branch in self.ancestors():
            branch.inactive_nodes[leaf.initial_rank] = self

    def activate(self, active_rank: int) -> None:
        leaf = self.leaf
        leaf.mode, leaf.active_rank = Mode.ACTIVE, active_rank
        self._leave_reserves()

    def terminate(self) -> None:
        self.leaf.mode = Mode.TERMINATED
        self._leave_reserves()

    def _leave_reserves(self) -> None:
        for branch in self.ancestors():
            branch.inactive_nodes.pop(self.leaf.initial_rank, None)

    def assign_backfill_domain(self) -> None:
        """The highest branch above this leaf reached through BACKFILL layers only."""
        self.backfill_domain = None
        for branch in self.ancestors():
            if branch.layer is None or not branch.layer.has(LayerFlag.BACKFILL):
                break
            self.backfill_domain = branch

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def bounded_activate(node: Node, counter: int, path: list[Node] | None = None) -> int:
    """Activate the leaves below `node` depth first, numbered from `counter`, while each
    branch above them (`path`, then the ones below `node`) has fewer active ranks than its
    layer's max_ranks; deactivate the others. Returns the next number."""
    path = [] if path is None else path
    if node.is_leaf():
        if all(_has_room(branch) for branch in path):
            node.activate(counter)
            counter += 1
            for branch in path:
                branch.active_count += 1
        else:
            node.deactivate()
        return counter
    path.append(node)
    for child in node.children.values():
        counter = bounded_activate(child, counter, path)
    path.pop()
    return counter


def _has_room(branch: Node) -> bool:
    limit = branch.layer.max_ranks if branch.layer is not None else None
    return limit is None or branch.active_count < limit


def propagate_terminations(node: Node, terminated_ranks: set[int]) -> set[int]:
    """Add to `terminated_ranks` (ranks, `LeafState.rank`) every rank of each branch below
    `node` left with fewer healthy ranks than its layer's min_ranks, children first; returns
    the set."""
    for child in node.children.values():
        terminated_ranks = propagate_terminations(child, terminated_ranks)
    if node.is_leaf() or node.layer is None:
        return terminated_ranks
    alive = [leaf.leaf.rank for leaf in node.iter_leaves() if leaf.leaf.mode is not Mode.TERMINATED]
    if sum(rank not in terminated_ranks for rank in alive) < node.layer.min_ranks:
        terminated_ranks.update(alive)
    return terminated_ranks


class Placer:
    """What NVRx's Tree keeps between restarts, for one placement."""

    def __init__(self, root: Node, world_size_filter: Callable[[int], int] | None) -> None:
        self.root = root
        self.leaves = list(root.iter_leaves())
        self.by_rank = {leaf.leaf.rank: leaf for leaf in self.leaves}
        self.world_size_filter = world_size_filter
        self.active_world_size = bounded_activate(root, 0)
        for leaf in self.leaves:
            leaf.assign_backfill_domain()

    def restart(self, lost: Set[int]) -> None:
        """One restart of NVRx's Tree: the ranks `lost` (LeafState.rank) are gone."""
        gone = propagate_terminations(self.root, set(lost))
        lost_active = sorted(r for r in gone if self.by_rank[r].leaf.mode is Mode.ACTIVE)
        index = {r: _active_rank(self.by_rank[r]) for r in lost_active}
        for rank in gone:
            self.by_rank[rank].terminate()
        unfilled = [r for r in lost_active if not self._take_reserve(self.by_rank[r], index[r])]
        if unfilled:
            vacated = sorted(self._backfill(unfilled, index))
            for leaf in self.leaves:
                if leaf.leaf.mode is Mode.ACTIVE:
                    active_rank = _active_rank(leaf)
                    leaf.leaf.active_rank = active_rank - bisect.bisect_left(vacated, active_rank)
            self.active_world_size -= len(unfilled)
        if self.world_size_filter is not None:
            self._filter(self.world_size_filter)
        for rank in gone:
            self.by_rank[rank].leaf.active_rank = None
        ordered = sorted(self.leaves, key=lambda leaf: leaf.leaf.mode is Mode.TERMINATED)
        self.by_rank = dict(enumerate(ordered))
        for rank, leaf in self.by_rank.items():
            leaf.leaf.rank = rank

    def _take_reserve(self, lost: Node, active_rank: int) -> bool:
        for branch in lost.ancestors():
            if branch.layer is None or not branch.layer.has(LayerFlag.RESERVE):
                return False
            if branch.inactive_nodes:
                branch.inactive_nodes[next(reversed(branch.inactive_nodes))].activate(active_rank)
                return True
        return False

    def _backfill(self, unfilled: Sequence[int], index: Mapping[int, int]) -> set[int]:
        """Move each BACKFILL branch's highest active ranks into its gaps; the active ranks
        vacated."""
        vacated: set[int] = set()
        gaps: dict[int, tuple[Node, list[int]]] = {}
        for rank in unfilled:
            domain = self.by_rank[rank].backfill_domain
            if domain is None:
                vacated.add(index[rank])
            else:
                gaps.setdefault(id(domain), (domain, []))[1].append(rank)
        for domain, ranks in gaps.values():
            active = [leaf for leaf in domain.iter_leaves() if leaf.leaf.mode is Mode.ACTIVE]
            movers = sorted(active, key=_active_rank)[-len(ranks) :]
            for rank, mover in itertools.zip_longest(ranks, movers):
                if mover is None:
                    vacated.add(index[rank])
                else:
                    vacated.add(_active_rank(mover))
                    mover.leaf.active_rank = index[rank]
        return vacated

    def _filter(self, world_size_filter: Callable[[int], int]) -> None:
        size = world_size_filter(self.active_world_size)
        if not _is_count(size) or size > self.active_world_size:
            raise ValueError(
                f"world_size_filter({self.active_world_size}) returned {size!r}: it must give "
                f"an int from 0 to {self.active_world_size}"
            )
        for leaf in self.leaves:
            if leaf.leaf.mode is Mode.ACTIVE and _active_rank(leaf) >= size:
                leaf.deactivate()
        self.active_world_size = size

    def placements(self) -> dict[int, Placement]:
        world_size = sum(leaf.leaf.mode is not Mode.TERMINATED for leaf in self.leaves)
        return {
            leaf.leaf.initial_rank: Placement(
                leaf.leaf.rank,
                world_size,
                leaf.leaf.mode,
                leaf.leaf.active_rank,
                self.active_world_size,
            )
            for leaf in self.leaves
        }


def _active_rank(leaf: Node) -> int:
    active_rank = leaf.leaf.active_rank
    if active_rank is None:
        raise TypeError(f"{leaf!r} is not active")
    return active_rank
