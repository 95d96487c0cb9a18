"""A state dict as a snapshot: its skeleton (tensors replaced by references to their bytes,
_skeleton.py's format: data only, never pickle) and where each tensor's bytes go; and the way
back, into a state dict in place.

Tensors never pass through the skeleton: their bytes are copied once, from the tensor into the
mapped snapshot, and once back. A tensor that appears twice in the state is stored once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ftd_client.checkpoint._errors import CheckpointError
from ftd_client.checkpoint._skeleton import Stored, decode, encode
from ftd_client.snapshot_format import align

__all__ = ["CheckpointError", "Plan", "Restorer", "Stored", "plan", "skeleton_of", "tensor_in"]


@dataclass
class Plan:
    skeleton: bytes
    tensors: list[tuple[torch.Tensor, Stored]] = field(default_factory=list)
    data_bytes: int = 0


class _Placer:
    """Where each tensor goes in the data region (a tensor seen before: where it went)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.seen: dict[int, Stored] = {}

    def __call__(self, obj: torch.Tensor) -> Stored:
        known = self.seen.get(id(obj))
        if known is not None:
            return known
        tensor = _plain(obj)
        stored = Stored(
            align(self.plan.data_bytes), tensor.dtype, tuple(tensor.shape), str(tensor.device)
        )
        self.plan.data_bytes = stored.offset + stored.nbytes
        self.plan.tensors.append((tensor, stored))
        self.seen[id(obj)] = stored
        return stored


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        raise CheckpointError(
            f"a {type(tensor).__name__} cannot be snapshotted by checkpoint.save "
            "(a distributed state dict: dcp.save with checkpoint.MemoryWriter())"
        )
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type == "meta":
        raise CheckpointError(
            f"a {tensor.layout} {tensor.device.type} tensor cannot be snapshotted"
        )
    return tensor.detach().resolve_conj().resolve_neg()


def plan(state: object) -> Plan:
    """The skeleton and the tensors of `state`; CheckpointError for a value a skeleton cannot
    hold, naming where it is (nothing is written then)."""
    result = Plan(b"")
    result.skeleton = encode(state, _Placer(result))
    return result


def tensor_in(buffer: Any, data_offset: int, stored: Stored) -> torch.Tensor:
    """The snapshot's bytes of `stored` as a CPU tensor over `buffer` (no copy)."""
    if stored.nbytes == 0:
        return torch.empty(stored.shape, dtype=stored.dtype)
    raw = torch.frombuffer(
        buffer, dtype=torch.uint8, count=stored.nbytes, offset=data_offset + stored.offset
    )
    return raw.view(stored.dtype).view(stored.shape)


def skeleton_of(data: bytes) -> Any:
    """The state dict a snapshot holds, with Stored where its tensors are; SkeletonError (a
    CheckpointError) for bytes that are not a skeleton. Nothing in them is run."""
    return decode(data)


class Restorer:
    """Fills a state dict in place from a snapshot's skeleton: a tensor of the same shape and
    type is copied into (one copy); anything else is replaced by the snapshot's value (with
    `copy=False`, a view of the snapshot's bytes: the tree of views persistence writes)."""

    def __init__(self, buffer: Any, data_offset: int, data_bytes: int, copy: bool = True) -> None:
        self.buffer = buffer
        self.data_offset = data_offset
        self.data_bytes = data_bytes
        self.copy = copy

    def into(self, target: Any, stored: Any) -> Any:
        if isinstance(stored, Stored):
            source = self._tensor(stored)
            if (
                isinstance(target, torch.Tensor)
                and target.shape == source.shape
                and target.dtype == source.dtype
            ):
                with torch.no_grad():
                    target.copy_(source)
                return target
            return source.to(stored.device, copy=True) if self.copy else source
        if isinstance(stored, dict) and isinstance(target, dict):
            for key, value in stored.items():
                if key in target:
                    filled = self.into(target[key], value)
                    if filled is not target[key]:
                        target[key] = filled
                else:
                    target[key] = self.into(None, value)
            return target
        if isinstance(stored, list) and isinstance(target, list) and len(stored) == len(target):
            for index, value in enumerate(stored):
                target[index] = self.into(target[index], value)
            return target
        if isinstance(stored, tuple) and type(stored) is not torch.Size:
            return type(stored)(self.into(None, value) for value in stored)
        if isinstance(stored, list | dict):  # decoded for this call alone: filled where it is
            for key, value in stored.items() if isinstance(stored, dict) else enumerate(stored):
                stored[key] = self.into(None, value)
        return stored

    def _tensor(self, stored: Stored) -> torch.Tensor:
        if stored.offset < 0 or stored.offset + stored.nbytes > self.data_bytes:
            raise CheckpointError("the snapshot's tensor lies outside its data")
        return tensor_in(self.buffer, self.data_offset, stored)
