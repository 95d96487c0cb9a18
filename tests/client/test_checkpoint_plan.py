"""A state dict into a snapshot's bytes and back (ftd_client/checkpoint/_plan.py), without a
daemon: every dtype and shape a state dict holds comes back bit for bit, tensors of the same
shape and type are filled in place, the rest replaced; what cannot be snapshotted is refused
before anything is written."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from ftd_client.checkpoint._plan import CheckpointError, Restorer, plan, skeleton_of, tensor_in
from ftd_client.snapshot_format import layout

Pair = collections.namedtuple("Pair", "left right")


def round_trip(state: Any, target: Any) -> Any:
    snapshot = plan(state)
    header = layout(7, 1, 0, len(snapshot.skeleton), snapshot.data_bytes)
    buffer = bytearray(header.total_bytes)
    for tensor, stored in snapshot.tensors:
        if stored.nbytes:
            tensor_in(buffer, header.data_offset, stored).copy_(tensor)
    buffer[header.skeleton_offset : header.data_offset] = snapshot.skeleton.ljust(
        header.data_offset - header.skeleton_offset, b"\0"
    )
    skeleton = skeleton_of(bytes(buffer[header.skeleton_offset : header.data_offset]))
    return Restorer(buffer, header.data_offset, header.data_bytes).into(target, skeleton)


def bits(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes (NaN == NaN, -0.0 != 0.0: bit for bit)."""
    return bytes(tensor.detach().contiguous().reshape(-1).view(torch.uint8).tolist())


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and (a.dtype, a.shape) == (b.dtype, b.shape)
            and bits(a) == bits(b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


def test_every_dtype_and_shape_comes_back_bit_for_bit() -> None:
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(6, 5, generator=generator)
    shared = torch.arange(10)
    state = {
        "f32": base,
        "f16": base.half(),
        "bf16": base.bfloat16(),
        "f64": base.double(),
        "i64": torch.randint(-(2**62), 2**62, (4,), generator=generator),
        "u8": torch.randint(0, 255, (3, 3), dtype=torch.uint8, generator=generator),
        "bool": base > 0,
        "c64": torch.complex(base, -base),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "transposed": base.t(),
        "slice": base[1:4, ::2],
        "twice": [shared, shared],
        "param": torch.nn.Parameter(base.clone()),
        "nan": torch.tensor([float("nan"), float("inf"), -0.0]),
        "python": {"n": 3, "lr": 1e-3, "name": "x", "none": None, "pair": Pair(1, base[0])},
    }
    restored = round_trip(state, {})
    expected = {**state, "param": state["param"].detach()}
    assert same(expected, restored), restored


def test_tensors_of_the_same_shape_and_type_are_filled_in_place() -> None:
    model = torch.nn.Linear(4, 2)
    state = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    target = model.state_dict()
    weight = model.weight
    result = round_trip({"model": state, "step": 9}, {"model": target, "step": 0})
    assert result["model"] is target and result["step"] == 9
    assert model.weight is weight and torch.equal(model.weight.detach(), state["weight"])
    other = round_trip({"w": torch.ones(3)}, {"w": torch.zeros(2)})  # another shape: replaced
    assert torch.equal(other["w"], torch.ones(3))


def test_an_optimizers_missing_state_is_put_in_the_dict() -> None:
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    fresh = torch.optim.Adam(model.parameters())
    target = {"optim": fresh.state_dict()}
    restored = round_trip({"optim": optimizer.state_dict()}, target)
    fresh.load_state_dict(restored["optim"])
    for p in model.parameters():
        assert torch.equal(fresh.state[p]["exp_avg"], optimizer.state[p]["exp_avg"])


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (lambda: 0, "every value that is not a tensor must pickle"),
        (torch.ones(2, 2).to_sparse(), "cannot be snapshotted"),
        (torch.empty(2, device="meta"), "cannot be snapshotted"),
    ],
    ids=["lambda", "sparse", "meta"],
)
def test_what_cannot_be_snapshotted_is_refused_before_anything_is_written(
    value: object, words: str
) -> None:
    with pytest.raises(CheckpointError, match=words):
        plan({"ok": torch.ones(2), "bad": value})
