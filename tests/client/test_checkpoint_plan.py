"""A state dict into a snapshot's bytes and back (ftd_client/checkpoint/_plan.py), without a
daemon: every dtype and shape a state dict holds comes back bit for bit, and what real jobs save
(a model's, an optimizer's and a scheduler's state dicts, RNG states) comes back whole, of the
same types; tensors of the same shape and type are filled in place, the rest replaced; what
cannot be snapshotted is refused before anything is written, naming where it is."""

from __future__ import annotations

import collections
import random
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
    end = header.skeleton_offset + header.skeleton_bytes
    buffer[header.skeleton_offset : end] = snapshot.skeleton
    skeleton = skeleton_of(bytes(buffer[header.skeleton_offset : end]))
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
        return (
            type(a) is type(b)
            and list(a) == list(b)
            and all(same(a[k], b[k]) for k in a)
            and same(getattr(a, "_metadata", None), getattr(b, "_metadata", None))
        )
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float) and isinstance(b, float):
        return repr(a) == repr(b)  # nan == nan, -0.0 != 0.0
    return type(a) is type(b) and bool(a == b)


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
        "python": {"n": 3, "lr": 1e-3, "name": "x", "none": None, "pair": (1, base[0])},
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
        (lambda: 0, r"state\['bad'\] cannot be snapshotted: a builtins.function; a snapshot holds"),
        (Pair(1, 2), r"state\['bad'\] cannot be snapshotted: a .*Pair"),
        ({"x": [1, {2}]}, r"state\['bad'\]\['x'\]\[1\] cannot be snapshotted: a builtins.set"),
        ({(1, (2,)): 3}, r"state\['bad'\] cannot be snapshotted: a key .* of type tuple"),
        (collections.defaultdict(int), "a collections.defaultdict"),
        (2**9000, "an int of over 8191 bits"),
        (torch.ones(2, 2).to_sparse(), "cannot be snapshotted"),
        (torch.empty(2, device="meta"), "cannot be snapshotted"),
    ],
    ids=["lambda", "namedtuple", "set", "key", "defaultdict", "huge-int", "sparse", "meta"],
)
def test_what_cannot_be_snapshotted_is_refused_before_anything_is_written(
    value: object, words: str
) -> None:
    with pytest.raises(CheckpointError, match=words):
        plan({"ok": torch.ones(2), "bad": value})


def test_what_real_jobs_save_comes_back_whole_and_loads_into_fresh_objects() -> None:
    """A model's state dict (an OrderedDict with `_metadata`, which load_state_dict reads for
    BatchNorm's version), Adam's and SGD's (int keys, param_groups of floats, bools, None,
    tuples), a scheduler's, a torch.Generator's state (a uint8 tensor) and random.getstate()
    (tuples of ints): the same values and types, bit for bit."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2)
    )
    adam = torch.optim.Adam(model[0].parameters(), lr=1e-3, foreach=False)
    sgd = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9, nesterov=True)
    scheduler = torch.optim.lr_scheduler.StepLR(adam, step_size=2, gamma=0.5)
    for _ in range(3):
        model(torch.randn(5, 4)).sum().backward()
        adam.step()
        sgd.step()
        scheduler.step()
    state = {
        "model": model.state_dict(),
        "adam": adam.state_dict(),
        "sgd": sgd.state_dict(),
        "scheduler": scheduler.state_dict(),
        "generator": torch.Generator().manual_seed(7).get_state(),
        "random": random.Random(3).getstate(),
        "misc": [torch.float16, torch.device("cpu"), torch.Size([2, 3]), b"raw", float("nan")],
    }
    restored = round_trip(state, {})
    assert same(state, restored), restored
    assert isinstance(restored["model"], collections.OrderedDict)
    assert restored["model"]._metadata == state["model"]._metadata  # type: ignore[attr-defined]
    fresh = torch.nn.Sequential(
        torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2)
    )
    fresh.load_state_dict(restored["model"])
    fresh_adam = torch.optim.Adam(fresh[0].parameters(), lr=1e-3, foreach=False)
    fresh_adam.load_state_dict(restored["adam"])
    fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_adam, step_size=2, gamma=0.5)
    fresh_scheduler.load_state_dict(restored["scheduler"])
    assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr()
    generator = torch.Generator()
    generator.set_state(restored["generator"])
    assert torch.equal(
        torch.rand(4, generator=generator),
        torch.rand(4, generator=torch.Generator().manual_seed(7)),
    )
    again = random.Random()
    again.setstate(restored["random"])
    assert again.random() == random.Random(3).random()
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert bits(p) == bits(q)


def test_a_skeleton_holds_no_pickle_and_a_pickle_is_no_skeleton(tmp_path: Any) -> None:
    """The skeleton is ftd's own format; a pickle where one is read (an older ftd's, or one
    planted) is refused without being run."""
    import pickle

    snapshot = plan({"w": torch.ones(2), "n": 1})
    assert snapshot.skeleton.startswith(b"FTDSKEL1") and b"\x80" not in snapshot.skeleton[:9]
    marker = tmp_path / "ran"

    class Planted:
        def __reduce__(self) -> tuple[Any, ...]:
            return (open, (str(marker), "w"))

    with pytest.raises(CheckpointError, match="not a skeleton of this ftd"):
        skeleton_of(pickle.dumps(Planted()))
    assert not marker.exists()
