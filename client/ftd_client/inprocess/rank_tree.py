"""NVRx's hierarchical rank assignment (`rank_assignment.Tree`, `Layer`, `LayerFlag`, and the
helpers `Node`, `bounded_activate`, `propagate_terminations`): NVRx's names, arguments,
defaults and rules; our code. `rank_assignment` exposes all of it, as NVRx does.

The ranks are the leaves of a tree with one level per Layer. The first layer is the root (the
job: every rank has the same key); each further layer splits its parent's ranks into branches
by a key, a string or a function of the rank's state (the host, the NVLink domain). A branch
activates at most its layer's `max_ranks` ranks, and a branch with fewer healthy ranks than
its layer's `min_ranks` is terminated whole (below the root's: the whole job). The parts
(Layer, LayerFlag, Node) and NVRx's algorithm, step by step, are rank_tree_placement.py's;
`Tree`, here, is the RankAssignment that builds the tree and runs the algorithm on it.

Under ftd (rank_assignment's docstring) every member places the whole job from the initial
layout and the initial ranks missing from the round: activation, one restart with no loss
(NVRx's first call, where a branch that starts below its min_ranks is terminated), then, if
ranks are missing, one restart with all of them. NVRx's Tree instead keeps its tree between
restarts and applies each restart's new losses to the tree the last one left. The two give the
same placement whenever NVRx sees every loss at one restart, the first loss in particular,
since NVRx then runs exactly those steps
(tests/client/inprocess/test_inprocess_rank_assignment.py compares both on random trees). After
losses at several restarts, the terminated ranks are the same (termination is a closure of the
lost set: its order does not matter), and so is the active world size without a
world_size_filter; but which reserve replaced whom, and who backfilled, depends in NVRx on the
order of the losses and here only on their set, so the active ranks may be held by other ranks
(and, with a filter, the active world size may differ). What ftd gains: every member, a
respawned process included (it knows no history), computes one placement from what the round
says (and the keys in the store), with no history to agree on, and a respawned rank that
rejoins takes back the place it had, which NVRx's Tree (its terminated ranks never come back)
cannot express.

Function keys are exchanged through the store (the Wrapper gives one under the attempt's key
prefix): each member publishes its keys once, under `ftd_tree/<name>/key/<initial rank>` (the
first value stays), and reads every member's and those of missing ranks that published before;
a rank that never did is not in the layout.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any

from ftd_client.inprocess.exceptions import RestartError
from ftd_client.inprocess.rank_assignment_base import (
    RankAssignment,
    RankAssignmentCtx,
    RankDiscarded,
)
from ftd_client.inprocess.rank_tree_placement import (
    MAX_KEY_CHARS,
    Layer,
    LeafState,
    Node,
    Placement,
    Placer,
)
from ftd_client.inprocess.state import Mode

log = logging.getLogger("ftd_client.inprocess")

MAX_RECORD_BYTES = 64 * 1024
"""The longest record of a rank's keys read from the store."""


class Tree(RankAssignment):
    """NVRx's hierarchical rank assignment (the module's docstring): `layers`, root first;
    `world_size_filter`, given the active world size, returns the one to use (no greater).
    Tree places the initial layout: no other RankAssignment may run before it."""

    _instances = itertools.count()

    def __init__(
        self, layers: list[Layer], world_size_filter: Callable[[int], int] | None = None
    ) -> None:
        if not layers or not all(isinstance(layer, Layer) for layer in layers):
            raise TypeError(f"Tree needs a list of one Layer or more, got {layers!r}")
        self.layers = list(layers)
        self.world_size_filter = world_size_filter
        self.name = f"{type(self).__name__}_{next(self._instances)}"
        self.tree: Node | None = None
        """The tree of the last placement this instance made (to inspect; each call builds
        its own)."""
        self._warned = False

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state = ctx.state
        if state.rank != state.initial_rank or state.world_size != state.initial_world_size:
            raise RestartError(
                f"{self.name} places the initial layout, but got rank {state.rank} of "
                f"{state.world_size}: no other rank assignment may run before a Tree"
            )
        layout = self._layout(ctx)
        mine = self.placement(layout, ctx.terminated_ranks).get(state.initial_rank)
        if mine is None or mine.mode is Mode.TERMINATED:
            raise RankDiscarded(
                f"rank={state.rank} terminated_ranks={sorted(ctx.terminated_ranks)}"
            )
        ctx.state = state.replace(
            rank=mine.rank,
            world_size=mine.world_size,
            mode=mine.mode,
            active_rank=mine.active_rank,
            active_world_size=mine.active_world_size,
        )
        ctx.terminated_ranks = set()
        return ctx

    def placement(
        self, layout: Mapping[int, Sequence[str]], terminated_ranks: Set[int] = frozenset()
    ) -> dict[int, Placement]:
        """Every rank's placement: `layout` gives each initial rank's keys (one per layer),
        `terminated_ranks` the initial ranks lost."""
        root = self._build(layout)
        placer = Placer(root, self.world_size_filter)
        placer.restart(set())
        lost = {
            leaf.leaf.rank for leaf in placer.leaves if leaf.leaf.initial_rank in terminated_ranks
        }
        lost -= {leaf.leaf.rank for leaf in placer.leaves if leaf.leaf.mode is Mode.TERMINATED}
        if lost:
            placer.restart(lost)
        self.tree = root
        return placer.placements()

    def _build(self, layout: Mapping[int, Sequence[str]]) -> Node:
        if not layout:
            raise ValueError(f"{self.name}: an empty layout")
        for slot, keys in layout.items():
            if len(keys) != len(self.layers):
                raise ValueError(
                    f"{self.name}: rank {slot} has {len(keys)} keys for {len(self.layers)} layers"
                )
        roots = {keys[0] for keys in layout.values()}
        if len(roots) != 1:
            raise RestartError(
                f"{self.name}: every rank needs the same key at the root layer, got "
                f"{sorted(roots)[:8]}"
            )
        root = Node(None, roots.pop(), self.layers[0], None)
        for slot in sorted(layout):
            node = root
            for key, layer in zip(layout[slot][1:], self.layers[1:], strict=True):
                node = node.children.get(key) or node.add_child(key, layer, None)
            node.add_child(slot, None, LeafState(slot, slot))
        order = [leaf.leaf.initial_rank for leaf in root.iter_leaves()]
        if order != sorted(order) and not self._warned:
            self._warned = True
            log.warning(
                "ftd: %s: the ranks' order does not follow the layers' groups: active ranks "
                "are numbered by group (depth first), not by the launcher's RANK",
                self.name,
            )
        return root

    # -- the keys of every rank --------------------------------------------------------------

    def _layout(self, ctx: RankAssignmentCtx) -> dict[int, tuple[str, ...]]:
        state = ctx.state
        mine = tuple(layer.key(state) for layer in self.layers)
        world = state.initial_world_size
        if not any(callable(layer.key_or_fn) for layer in self.layers):
            return dict.fromkeys(range(world), mine)
        store = ctx.store
        if store is None:
            raise RestartError(f"{self.name}: a layer's key is a function: it needs the store")
        published = store.compare_set(self.store_key(state.initial_rank), "", json.dumps(mine))
        if self._parse(state.initial_rank, published) != mine:
            log.warning("ftd: %s: this rank's keys changed; the first ones stay", self.name)
        members = [slot for slot in range(world) if slot not in ctx.terminated_ranks]
        try:
            store.wait([self.store_key(slot) for slot in members])
        except RuntimeError as error:  # torch's DistError: the store's timeout
            raise RestartError(
                f"{self.name}: not every member published its keys: {error}"
            ) from error
        values = store.multi_get([self.store_key(slot) for slot in members])
        raw: dict[int, Any] = dict(zip(members, values, strict=True))
        for slot in sorted(ctx.terminated_ranks & set(range(world))):
            if store.check([self.store_key(slot)]):
                raw[slot] = store.get(self.store_key(slot))
        return {slot: self._parse(slot, value) for slot, value in raw.items()}

    def store_key(self, slot: int) -> str:
        """Where rank `slot` publishes its keys in the store."""
        return f"ftd_tree/{self.name}/key/{slot}"

    def _parse(self, slot: int, raw: object) -> tuple[str, ...]:
        """A rank's keys as published in the store: a JSON list, one string per layer."""
        try:
            if not isinstance(raw, (bytes, str)) or len(raw) > MAX_RECORD_BYTES:
                raise ValueError(f"not a record of at most {MAX_RECORD_BYTES} bytes")
            keys = json.loads(raw)
            if not isinstance(keys, list) or len(keys) != len(self.layers):
                raise ValueError(f"not a list of {len(self.layers)} keys")
            if not all(isinstance(key, str) and len(key) <= MAX_KEY_CHARS for key in keys):
                raise ValueError(f"not strings of at most {MAX_KEY_CHARS} characters")
        except ValueError as error:  # json's errors, UnicodeDecodeError included
            raise RestartError(
                f"{self.name}: the keys of rank {slot} in the store are not valid ({error}); "
                "every rank must run the same Tree"
            ) from None
        return tuple(keys)
