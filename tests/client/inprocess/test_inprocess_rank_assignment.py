"""NVRx's hierarchical rank assignment (rank_assignment.Tree, Layer, LayerFlag): placements by
hand, properties on random trees, NVRx's own Tree on the same inputs where it is installed,
the keys exchanged through a real TCPStore, and a reserve taking a lost rank's place under a
real `ftd serve --restart-mode inprocess`."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from ftd_client import inprocess
from ftd_client.inprocess import FrozenState, Mode
from ftd_client.inprocess.exceptions import RestartError
from ftd_client.store import tcp_store_client, tcp_store_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import BIN, ServeFactory
from tests.support.inprocess import ENV, PRELOAD, initial_state, run_ranks

ra = inprocess.rank_assignment
RESERVE, BACKFILL = ra.LayerFlag.RESERVE, ra.LayerFlag.BACKFILL
Layout = dict[int, tuple[str, ...]]

HAVE_NVRX = importlib.util.find_spec("nvidia_resiliency_ext") is not None


def flat(world: int) -> Layout:
    return {slot: ("job",) for slot in range(world)}


def domains(world: int, size: int) -> Layout:
    """NVLink-like domains of `size` consecutive ranks under one job."""
    return {slot: ("job", f"nvl{slot // size}") for slot in range(world)}


def active(placement: Mapping[int, ra.Placement]) -> dict[int, int | None]:
    """Each active initial rank's active rank."""
    return {s: p.active_rank for s, p in placement.items() if p.mode is Mode.ACTIVE}


def in_mode(placement: Mapping[int, ra.Placement], mode: Mode) -> set[int]:
    return {slot for slot, p in placement.items() if p.mode is mode}


def by_rank(*slots: int) -> dict[int, int | None]:
    """Active ranks 0, 1, 2... held by these initial ranks, in that order."""
    return {slot: rank for rank, slot in enumerate(slots)}


# -- placements by hand -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lost", "expected", "reserves"),
    [
        (set(), by_rank(0, 1, 2, 3, 4, 5), {6, 7}),
        ({2}, by_rank(0, 1, 7, 3, 4, 5), {6}),  # the reserve that became inactive last
        ({2, 4}, by_rank(0, 1, 7, 3, 6, 5), set()),
        ({2, 4, 5}, by_rank(0, 1, 7, 3, 6), set()),  # no reserve left: the gap closes
        ({6}, by_rank(0, 1, 2, 3, 4, 5), {7}),  # a reserve lost
    ],
    ids=["start", "one loss", "two losses", "three losses", "a reserve lost"],
)
def test_one_layer_with_reserves(
    lost: set[int], expected: dict[int, int], reserves: set[int]
) -> None:
    tree = ra.Tree([ra.Layer(max_ranks=6, key_or_fn="job", flag=RESERVE)])
    placement = tree.placement(flat(8), lost)
    assert active(placement) == expected
    assert in_mode(placement, Mode.INACTIVE) == reserves
    assert in_mode(placement, Mode.TERMINATED) == lost
    assert {p.world_size for p in placement.values()} == {8 - len(lost)}
    assert {p.active_world_size for p in placement.values()} == {len(expected)}
    healthy = sorted(slot for slot in placement if slot not in lost)
    assert [placement[slot].rank for slot in healthy] == list(range(len(healthy)))


def test_one_layer_shifts_or_backfills_without_reserves() -> None:
    shifted = ra.Tree([ra.Layer(key_or_fn="job")]).placement(flat(8), {1, 4, 5})
    assert active(shifted) == by_rank(0, 2, 3, 6, 7)  # as ShiftRanks
    backfilled = ra.Tree([ra.Layer(key_or_fn="job", flag=BACKFILL)]).placement(flat(8), {1, 4, 5})
    # NVRx's backfill: the highest active ranks, lowest first, into the gaps in rank order
    # (3 into 1, 6 into 4, 7 into 5), then the gaps they left close.
    assert active(backfilled) == by_rank(0, 3, 2, 6, 7)


@pytest.mark.parametrize(
    ("size", "lost", "expected", "reserves"),
    [
        (4, set(), by_rank(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14), {3, 7, 11, 15}),
        (4, {0}, by_rank(3, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14), {7, 11, 15}),
        # the domain's own reserve first, then through the job: the last domain's
        (4, {0, 1}, by_rank(3, 15, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14), {7, 11}),
        (4, {0, 1, 2, 3}, by_rank(15, 11, 7, 4, 5, 6, 8, 9, 10, 12, 13, 14), set()),
        (8, {0}, by_rank(7, *range(1, 7), *range(8, 15)), {15}),
        (8, {0, 1}, by_rank(7, 15, *range(2, 7), *range(8, 15)), set()),
        # a whole domain lost, one reserve elsewhere: six gaps close
        (8, set(range(8)), by_rank(15, *range(8, 15)), set()),
    ],
    ids=["4: start", "4: one", "4: two", "4: domain", "8: one", "8: two", "8: domain"],
)
def test_nvlink_domains_with_one_reserve_each(
    size: int, lost: set[int], expected: dict[int, int], reserves: set[int]
) -> None:
    tree = ra.Tree(
        [
            ra.Layer(key_or_fn="job", flag=RESERVE),
            ra.Layer(
                max_ranks=size - 1, key_or_fn=lambda s: str(s.initial_rank // size), flag=RESERVE
            ),
        ]
    )
    placement = tree.placement(domains(16, size), lost)
    assert active(placement) == expected
    assert in_mode(placement, Mode.INACTIVE) == reserves
    assert in_mode(placement, Mode.TERMINATED) == lost


def test_backfill_keeps_a_domains_ranks_together() -> None:
    tree = ra.Tree([ra.Layer(key_or_fn="job"), ra.Layer(key_or_fn="nvl", flag=BACKFILL)])
    placement = tree.placement(domains(8, 4), {1})
    assert active(placement) == by_rank(0, 3, 2, 4, 5, 6, 7)  # 3 moved into 1's place


def test_a_domain_below_min_ranks_is_terminated_whole() -> None:
    tree = ra.Tree(
        [ra.Layer(key_or_fn="job", flag=RESERVE), ra.Layer(min_ranks=3, key_or_fn="nvl")]
    )
    placement = tree.placement(domains(8, 4), {0, 1})
    assert in_mode(placement, Mode.TERMINATED) == {0, 1, 2, 3}
    assert active(placement) == by_rank(4, 5, 6, 7)
    assert {p.world_size for p in placement.values()} == {4}
    # A domain that starts below its min_ranks is terminated at the first round (NVRx's
    # first call), before any loss.
    short = tree.placement(domains(6, 4))
    assert in_mode(short, Mode.TERMINATED) == {4, 5}
    assert active(short) == by_rank(0, 1, 2, 3)


def test_the_job_below_min_ranks_discards_every_rank() -> None:
    """As in NVRx: every rank raises RankDiscarded, so every process exits."""
    tree = ra.Tree([ra.Layer(min_ranks=6, key_or_fn="job"), ra.Layer(key_or_fn="nvl")])
    assert in_mode(tree.placement(domains(8, 4), {0, 5, 6}), Mode.TERMINATED) == set(range(8))
    members = [1, 2, 3, 4, 7]
    for slot in members:
        with pytest.raises(ra.RankDiscarded):
            ra.assign(tree, initial_state(slot, 8), members, None)


def test_world_size_filter_makes_reserves() -> None:
    tree = ra.Tree([ra.Layer(key_or_fn="job")], world_size_filter=lambda n: n // 4 * 4)
    placement = tree.placement(flat(8), {1})
    assert active(placement) == by_rank(0, 2, 3, 4)
    assert in_mode(placement, Mode.INACTIVE) == {5, 6, 7}
    assert {p.active_world_size for p in placement.values()} == {4}


def test_a_string_key_needs_no_store() -> None:
    tree = ra.Tree([ra.Layer(max_ranks=2, key_or_fn="job", flag=RESERVE)])
    states = {slot: ra.assign(tree, initial_state(slot, 3), [1, 2], None) for slot in (1, 2)}
    assert (states[2].mode, states[2].active_rank, states[2].active_world_size) == (
        Mode.ACTIVE,
        0,
        2,
    )
    assert (states[1].rank, states[2].rank, states[1].world_size) == (0, 1, 2)
    with pytest.raises(ra.RankDiscarded):
        ra.assign(tree, initial_state(0, 3), [1, 2], None)


# -- keys that are functions: exchanged through a real TCPStore ---------------------------------


@pytest.fixture(scope="module")
def store_port() -> Iterator[int]:
    server = tcp_store_server("127.0.0.1")
    yield server.port
    del server


def named(make: Callable[[], ra.Tree], slots: list[int]) -> dict[int, ra.Tree]:
    """One Tree per rank, all with one name, as each process builds its own."""
    name = f"tree-{uuid.uuid4().hex}"
    trees = {slot: make() for slot in slots}
    for tree in trees.values():
        tree.name = name
    return trees


def test_a_function_key_is_exchanged_through_the_store(store_port: int) -> None:
    """Pairs by a function of the rank (an int key is taken as its digits), one reserve."""

    def make() -> ra.Tree:
        return ra.Tree(
            [
                ra.Layer(max_ranks=5, key_or_fn="job", flag=RESERVE),
                ra.Layer(key_or_fn=lambda s: s.initial_rank // 2, flag=RESERVE),  # type: ignore[arg-type,return-value]
            ]
        )

    trees = named(make, list(range(6)))
    first = run_ranks(trees, 6, list(range(6)), store_port)
    assert {s: r.active_rank for s, r in first.items() if isinstance(r, FrozenState)} == {
        **by_rank(0, 1, 2, 3, 4),
        5: None,
    }
    second = run_ranks(trees, 6, [0, 2, 3, 4, 5], store_port)  # slot 1 lost, published before
    assert {s: r.active_rank for s, r in second.items() if isinstance(r, FrozenState)} == by_rank(
        0, 5, 2, 3, 4
    )
    expected = make().placement({s: ("job", str(s // 2)) for s in range(6)}, {1})
    assert {s: r.active_rank for s, r in second.items() if isinstance(r, FrozenState)} == {
        s: p.active_rank for s, p in expected.items() if s != 1
    }


# -- attacks: what other ranks wrote, what the user gave -----------------------------------------


def function_tree() -> ra.Tree:
    return ra.Tree([ra.Layer(key_or_fn="job"), ra.Layer(key_or_fn=lambda s: "a")])


@pytest.mark.parametrize(
    "record",
    [b"not json", b'["job"]', b'["job", 7]', json.dumps(["job", "x" * 2000]).encode(), b"\xff\xfe"],
    ids=["not json", "one key short", "not a string", "too long", "not utf-8"],
)
def test_a_bad_record_in_the_store_is_refused(store_port: int, record: bytes) -> None:
    tree = function_tree()
    store = tcp_store_client("127.0.0.1", store_port, 5)
    store.set(tree.store_key(1), record)  # a lost rank's keys, as the store has them
    with pytest.raises(RestartError, match="the keys of rank 1 in the store are not valid"):
        ra.assign(tree, initial_state(0, 2), [0], store)
    mine = function_tree()
    store.set(mine.store_key(0), record)  # this rank's own, written by someone else
    with pytest.raises(RestartError, match="the keys of rank 0 in the store are not valid"):
        ra.assign(mine, initial_state(0, 1), [0], store)


def test_a_member_that_never_publishes_ends_the_wait(store_port: int) -> None:
    store = tcp_store_client("127.0.0.1", store_port, 1)  # the store's timeout bounds the wait
    with pytest.raises(RestartError, match="not every member published its keys"):
        ra.assign(function_tree(), initial_state(0, 2), [0, 1], store)


def test_refusals() -> None:
    with pytest.raises(RestartError, match="needs the store"):
        ra.assign(function_tree(), initial_state(0, 1), [0], None)
    split_root = ra.Tree([ra.Layer(key_or_fn="a"), ra.Layer(key_or_fn="b")])
    with pytest.raises(RestartError, match="the same key at the root layer"):
        split_root.placement({0: ("a", "x"), 1: ("b", "x")})
    after_shift = inprocess.Compose(ra.Tree([ra.Layer(key_or_fn="job")]), ra.ShiftRanks())
    with pytest.raises(RestartError, match="no other rank assignment may run before a Tree"):
        ra.assign(after_shift, initial_state(1, 3), [1, 2], None)
    too_big = ra.Tree([ra.Layer(key_or_fn="job")], world_size_filter=lambda n: n + 1)
    with pytest.raises(ValueError, match="world_size_filter"):
        too_big.placement(flat(4))
    odd_key = ra.Tree([ra.Layer(key_or_fn=lambda s: object())])  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="must give a str"):
        ra.assign(odd_key, initial_state(0, 1), [0], None)
    long_key = ra.Tree([ra.Layer(key_or_fn="x" * 2000)])
    with pytest.raises(ValueError, match="at most 1024 characters"):
        ra.assign(long_key, initial_state(0, 1), [0], None)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"min_ranks": -1}, ValueError),
        ({"min_ranks": True}, ValueError),
        ({"max_ranks": "8"}, ValueError),
        ({"key_or_fn": 3}, TypeError),
        ({"flag": "RESERVE"}, TypeError),
    ],
)
def test_a_bad_layer_is_refused(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error, match="Layer"):
        ra.Layer(**kwargs)
    with pytest.raises(TypeError, match="one Layer or more"):
        ra.Tree([])


# -- properties ----------------------------------------------------------------------------------

FLAGS = st.sampled_from([None, RESERVE, BACKFILL, RESERVE | BACKFILL])


@st.composite
def trees(draw: st.DrawFn) -> tuple[ra.Tree, Layout, set[int]]:
    """A random tree of 1 to 3 layers over up to 16 ranks, groups consecutive or
    interleaved, with a random set of lost ranks."""
    world = draw(st.integers(1, 16))
    depth = draw(st.integers(1, 3))
    layers = [
        ra.Layer(
            min_ranks=draw(st.integers(0, 3)),
            max_ranks=draw(st.none() | st.integers(0, 10)),
            key_or_fn="job" if level == 0 else "group",
            flag=draw(FLAGS),
        )
        for level in range(depth)
    ]
    sizes = [draw(st.integers(1, 5)) for _ in range(depth)]
    interleaved = draw(st.booleans())
    layout = {
        slot: ("job", *(str(slot % g if interleaved else slot // g) for g in sizes[1:]))
        for slot in range(world)
    }
    filters: list[Callable[[int], int] | None] = [None, lambda n: n // 2 * 2]
    tree = ra.Tree(layers, world_size_filter=draw(st.sampled_from(filters)))
    lost = draw(st.sets(st.integers(0, world - 1)))
    return tree, layout, lost


@settings(max_examples=300, deadline=None)
@given(trees())
def test_placements_keep_their_invariants(case: tuple[ra.Tree, Layout, set[int]]) -> None:
    tree, layout, lost = case
    placement = tree.placement(layout, lost)
    assert placement == tree.placement(layout, lost)  # the same input, the same placement
    terminated = in_mode(placement, Mode.TERMINATED)
    assert lost <= terminated  # no lost rank is active, nor a reserve
    healthy = [slot for slot in placement if slot not in terminated]
    assert sorted(placement[slot].rank for slot in healthy) == list(range(len(healthy)))
    assert {p.world_size for p in placement.values()} == {len(healthy)}
    (size,) = {p.active_world_size for p in placement.values()}
    assert sorted(rank for rank in active(placement).values() if rank is not None) == list(
        range(size)
    )
    assert tree.tree is not None
    for branch in branches(tree.tree):  # a branch that survives keeps its min_ranks
        alive = [leaf for leaf in branch.iter_leaves() if leaf.leaf.mode is not Mode.TERMINATED]
        assert not alive or len(alive) >= (branch.layer.min_ranks if branch.layer else 0)


def branches(node: ra.Node) -> Iterator[ra.Node]:
    if not node.is_leaf():
        yield node
        for child in node.children.values():
            yield from branches(child)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(trees(), st.booleans())
def test_every_rank_computes_the_same_placement(
    store_port: int, case: tuple[ra.Tree, Layout, set[int]], lost_published: bool
) -> None:
    """Through the real per-rank path: each member computes its keys with a function, they
    meet in the store, and each builds the whole tree itself. The lost ranks published their
    keys in an earlier round, or never did (then they are not in the layout)."""
    model, layout, lost = case
    world = len(layout)
    members = [slot for slot in range(world) if slot not in lost]
    if not members:
        return

    def key_at(level: int) -> Callable[[FrozenState], str]:
        return lambda state: layout[state.initial_rank][level]

    def make() -> ra.Tree:
        layers = [
            dataclasses.replace(layer, key_or_fn=key_at(level))
            for level, layer in enumerate(model.layers)
        ]
        return ra.Tree(layers, model.world_size_filter)

    trees_by_slot = named(make, members)
    known = {slot: layout[slot] for slot in (range(world) if lost_published else members)}
    if lost_published:
        store = tcp_store_client("127.0.0.1", store_port, 30)
        for slot in lost:
            store.set(trees_by_slot[members[0]].store_key(slot), json.dumps(layout[slot]))
    results = run_ranks(trees_by_slot, world, members, store_port)
    expected = model.placement(known, lost)
    snapshots = {slot: leaves(tree) for slot, tree in trees_by_slot.items()}
    assert all(snapshot == snapshots[members[0]] for snapshot in snapshots.values())
    assert snapshots[members[0]] == {
        s: (p.rank, p.mode, p.active_rank) for s, p in expected.items()
    }
    for slot, result in results.items():
        if expected[slot].mode is Mode.TERMINATED:
            assert isinstance(result, ra.RankDiscarded)
        else:
            assert isinstance(result, FrozenState)
            assert (result.rank, result.mode, result.active_rank) == (
                expected[slot].rank,
                expected[slot].mode,
                expected[slot].active_rank,
            )


def leaves(tree: ra.Tree) -> dict[int, tuple[int, Mode, int | None]]:
    assert tree.tree is not None
    return {
        leaf.leaf.initial_rank: (leaf.leaf.rank, leaf.leaf.mode, leaf.leaf.active_rank)
        for leaf in tree.tree.iter_leaves()
    }


# -- NVRx's own Tree on the same inputs ----------------------------------------------------------


class _LayoutStore:
    """What NVRx's Tree reads from its store when it builds the tree: every rank's state and
    keys (NVRx's own store is an edge we do not own)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    def send_state(self, state: Any, rank: int) -> None:
        pass

    def get_states(self, ranks: range) -> list[Any]:
        state = importlib.import_module("nvidia_resiliency_ext.inprocess.state")
        return [state.State(rank=rank, world_size=len(self.layout)) for rank in ranks]

    def send_key(self, key: Any, rank: int) -> None:
        pass

    def get_keys(self, ranks: range) -> list[list[str]]:
        return [list(self.layout[rank]) for rank in ranks]


def nvrx_placement(tree: ra.Tree, layout: Layout, lost: set[int]) -> dict[int, ra.Placement]:
    """NVRx's Tree: its first call, then one call with every lost rank."""
    nvrx = importlib.import_module("nvidia_resiliency_ext.inprocess.rank_assignment")
    nvrx_state = importlib.import_module("nvidia_resiliency_ext.inprocess.state")

    layers = [
        nvrx.Layer(
            min_ranks=layer.min_ranks,
            max_ranks=layer.max_ranks,
            key_or_fn="unused",
            flag=None if layer.flag is None else nvrx.LayerFlag(layer.flag.value),
        )
        for layer in tree.layers
    ]
    theirs = nvrx.Tree(layers, tree.world_size_filter)
    store = _LayoutStore(layout)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NVRx warns when groups interleave the ranks
        for terminated in (None, lost):
            nodes = list(theirs.tree.iter_leaves()) if theirs.tree is not None else []
            alive = [n.state for n in nodes if n.state.mode != nvrx_state.Mode.TERMINATED]
            if terminated is None:
                caller, ranks = nvrx_state.State(rank=0, world_size=len(layout)), set()
            else:
                ranks = {s.rank for s in alive if s.initial_rank in terminated}
                if not ranks:
                    break
                caller = nvrx_state.State(**dataclasses.asdict(alive[0]))
            with contextlib.suppress(nvrx.RankDiscarded):
                theirs(nvrx.RankAssignmentCtx(caller, store, ranks))
    result = {}
    for leaf in theirs.tree.iter_leaves():
        s = leaf.state
        mode = Mode[s.mode.name]
        rank = -1 if mode is Mode.TERMINATED else s.rank  # NVRx forgets a terminated rank's
        result[s.initial_rank] = ra.Placement(
            rank, s.world_size, mode, s.active_rank, s.active_world_size
        )
    return result


@pytest.mark.skipif(
    not HAVE_NVRX, reason="nvidia-resiliency-ext is not installed (pip install -e '.[nvrx]')"
)
@settings(max_examples=300, deadline=None)
@given(trees())
def test_the_same_placements_as_nvrx(case: tuple[ra.Tree, Layout, set[int]]) -> None:
    tree, layout, lost = case
    ours = {
        slot: dataclasses.replace(p, rank=-1) if p.mode is Mode.TERMINATED else p
        for slot, p in tree.placement(layout, lost).items()
    }
    assert ours == nvrx_placement(tree, layout, lost)


# -- a reserve under `ftd serve` ----------------------------------------------------------------


@pytest.mark.timeout(90)
async def test_a_tree_reserve_takes_a_lost_ranks_place(serve: ServeFactory, tmp_path: Path) -> None:
    """4 ranks in pairs (their key a function, exchanged through the daemon's store), at most 3
    active: slot 3 waits as the reserve until slot 1 dies (not respawned), then takes its
    active rank, 1, in round 1."""
    out = tmp_path / "out"
    run = await serve(
        "--nproc-per-node", "4", "--restart-mode", "inprocess", "--no-inprocess-respawn",
        *PRELOAD,
        script=BIN / "inprocess_reserve.py", script_args=("--out", str(out), "--tree"), env=ENV,
    )  # fmt: skip
    assert await run.wait(timeout=80) == 0, run.stderr.text[-3000:]

    def call(name: str) -> dict[str, int]:
        data: dict[str, int] = json.loads((out / name).read_text())
        return data

    assert [call(f"call_i0_s{slot}.json") for slot in (0, 1, 2)] == [
        {"rank": rank, "world": 3} for rank in (0, 1, 2)
    ]
    assert not (out / "call_i0_s3.json").exists()  # the reserve did not call the function
    assert [call(f"call_i1_s{slot}.json") for slot in (0, 3, 2)] == [
        {"rank": rank, "world": 3} for rank in (0, 1, 2)
    ]
    assert {call(f"final_s{slot}.json")["sum"] for slot in (0, 2, 3)} == {3.0}
    assert all((out / f"returned_s{slot}.json").exists() for slot in (0, 2, 3))
