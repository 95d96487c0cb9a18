"""The skeleton's decoder (ftd_client/checkpoint/_skeleton.py), which replaced pickle: any bytes
(random, or a real skeleton mutated) give a tree or SkeletonError, within the per-input CPU
budget; any tree the encoder takes comes back equal, of the same types; its bounds hold."""

from __future__ import annotations

import collections
import random
import time
import tracemalloc
from typing import Any

import pytest
import torch
from ftd_client.checkpoint._plan import plan
from ftd_client.checkpoint._skeleton import (
    MAGIC,
    MAX_DEPTH,
    SkeletonError,
    Stored,
    decode,
    encode,
)
from hypothesis import given
from hypothesis import strategies as st

from tests.support.fuzzing import budget, fuzz_target

BUDGET_S = 0.1


def real_skeleton() -> bytes:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    return plan(
        {
            "model": model.state_dict(),
            "optim": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "random": random.Random(1).getstate(),
            "misc": (torch.float16, torch.device("cpu"), torch.Size([2]), b"x", 2**70, None),
        }
    ).skeleton


REAL = real_skeleton()


def decoded(data: bytes) -> None:
    with budget(BUDGET_S):
        try:
            decode(data)
        except SkeletonError:
            return


@fuzz_target("snapshot_skeleton", 300)
@given(st.binary(max_size=400), st.booleans())
def test_any_bytes_are_a_skeleton_or_refused(data: bytes, magic: bool) -> None:
    decoded(MAGIC + data if magic else data)


edits = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 1 << 20), st.integers(0, 255)),
    min_size=1,
    max_size=8,
)


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    out = bytearray(data)
    for kind, where, value in edits:
        at = where % (len(out) + 1)
        if kind == 0 and at < len(out):
            out[at] = value
        elif kind == 1:
            out[at:at] = bytes([value])
        elif kind == 2:
            del out[at : at + 1 + value % 8]
        else:
            del out[at:]
    return bytes(out)


@fuzz_target("snapshot_skeleton", 300)
@given(edits)
def test_a_mutated_real_skeleton_is_a_skeleton_or_refused(
    edits: list[tuple[int, int, int]],
) -> None:
    decoded(mutate(REAL, edits))


keys = st.one_of(
    st.text(max_size=8),
    st.integers(-(2**61) + 2, 2**61 - 2),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
    st.tuples(st.integers(0, 9), st.text(max_size=3)),
)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**300), 2**300),
    st.floats(),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.sampled_from([torch.float32, torch.bfloat16, torch.uint8, torch.bool, torch.complex64]),
    st.sampled_from([torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")]),
    st.lists(st.integers(0, 2**40), max_size=4).map(torch.Size),
    st.builds(
        Stored,
        st.integers(0, 2**40),
        st.sampled_from([torch.float32, torch.int64, torch.float8_e4m3fn]),
        st.lists(st.integers(0, 9), max_size=4).map(tuple),
        st.sampled_from(["cpu", "cuda:0"]),
    ),
)


def ordered(pairs: dict[Any, Any], metadata: dict[Any, Any] | None) -> Any:
    value: Any = collections.OrderedDict(pairs)
    if metadata is not None:
        value._metadata = metadata
    return value


def metadata(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[Any, Any] | None]:
    return st.none() | st.dictionaries(st.text(max_size=4), inner, max_size=2)


trees = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(keys, inner, max_size=4),
        st.builds(ordered, st.dictionaries(keys, inner, max_size=4), metadata(inner)),
    ),
    max_leaves=30,
)


def same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return (
            list(a) == list(b)
            and all(same(a[k], b[k]) for k in a)
            and same(getattr(a, "_metadata", None), getattr(b, "_metadata", None))
        )
    if isinstance(a, list | tuple) and not isinstance(a, torch.Size):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float):
        return repr(a) == repr(b)  # nan, -0.0: the same bits' meaning
    return bool(a == b)


def place(tensor: torch.Tensor) -> Stored:
    raise AssertionError("no tensor in these trees")


@fuzz_target("snapshot_skeleton", 200)
@given(trees)
def test_any_tree_the_encoder_takes_comes_back_equal(tree: Any) -> None:
    """Property: a tree of the types a skeleton holds (Stored standing in for the tensors'
    references) round-trips, keys and their order, types and _metadata included."""
    data = encode(tree, place)
    assert same(tree, decode(data))


def test_what_no_skeleton_is_is_refused_quickly() -> None:
    deep = MAGIC + b"l\x01" * (MAX_DEPTH + 1) + b"N"
    cases = {
        "not a skeleton of this ftd": b"\x80\x04K\x01.",
        "nested deeper": deep,
        "a length of": MAGIC + b"l" + b"\xff" * 9 + b"\x01",
        "cut short": MAGIC + b"f\x00\x00",
        "bytes after the skeleton": MAGIC + b"NN",
        "unknown tag": MAGIC + b"Z",
        "a dict key twice": MAGIC + b"d\x02s\x01aNs\x01aN",
        "a dict key of type list": MAGIC + b"d\x01l\x00N",
        "no tensor type": MAGIC + b"R\x00\x04evil\x00\x03cpu",
        "no device": MAGIC + b"v\x0bcpu; import",
        "an int of": MAGIC + b"i\x00",
    }
    for words, data in cases.items():
        with budget(BUDGET_S), pytest.raises(SkeletonError, match=words):
            decode(data)


def test_keys_that_hash_alike_are_bounded() -> None:
    """Floats 2**(61k) all hash to 1 (and tuples of them alike): at most MAX_ODD_KEYS such
    keys in a skeleton, so no dict is made to scan long chains."""
    import struct

    colliding = [2.0 ** (61 * k) for k in range(-15, 16)]
    pairs = [(a, b) for a in colliding for b in colliding[:12]]
    body = b"".join(
        b"t\x02f" + struct.pack("<d", a) + b"f" + struct.pack("<d", b) + b"N" for a, b in pairs
    )
    data = MAGIC + b"d" + bytes([len(pairs) & 0x7F | 0x80, len(pairs) >> 7]) + body
    started = time.thread_time()
    with pytest.raises(SkeletonError, match="keys not str nor int"):
        decode(data)
    assert time.thread_time() - started < 1.0


def test_time_and_memory_stay_linear_in_the_bytes() -> None:
    """The costliest bytes per byte (empty dicts, two bytes each): decoded in linear time,
    holding a bounded multiple of the input."""
    count = 100_000
    data = MAGIC + b"l" + bytes([count & 0x7F | 0x80, (count >> 7) & 0x7F | 0x80, count >> 14])
    data += b"d\x00" * count
    tracemalloc.start()
    try:
        started = time.thread_time()
        tree = decode(data)
        spent = time.thread_time() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(tree) == count and spent < 5.0
    assert peak < 64 * len(data) + (1 << 20), peak


def test_what_the_decoder_would_refuse_is_never_written() -> None:
    """The encoder holds the decoder's bounds, so a snapshot taken is one that can be read."""
    from ftd_client.checkpoint import CheckpointError

    odd: Any = collections.OrderedDict(a=1)
    odd._metadata = [1]
    nested: list[Any] = []
    for _ in range(MAX_DEPTH + 1):
        nested = [nested]
    cases = {
        "over 256 dict keys": {float(k): None for k in range(300)},
        "nested deeper than 64": nested,
        "._metadata cannot be snapshotted: not a dict": odd,
    }
    for words, tree in cases.items():
        with pytest.raises(CheckpointError, match=words):
            encode({"x": tree}, place)
