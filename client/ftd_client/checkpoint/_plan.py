"""A state dict as a snapshot: its skeleton (pickled, tensors replaced by references to their
bytes) and where each tensor's bytes go; and the way back, into a state dict in place.

The skeleton is pickled like torch.save does (every value that is not a tensor must pickle);
tensors are referenced by persistent ids, so their bytes never pass through pickle: they are
copied once, from the tensor into the mapped snapshot, and once back.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch

from ftd_client.snapshot_format import align


class CheckpointError(RuntimeError):
    """A snapshot that cannot be taken or restored; what the training holds is unchanged."""


@dataclass(frozen=True)
class Stored:
    """A tensor of the snapshot: where its bytes are (from the data region's start)."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: str

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * int(self.dtype.itemsize)


@dataclass
class Plan:
    skeleton: bytes
    tensors: list[tuple[torch.Tensor, Stored]] = field(default_factory=list)
    data_bytes: int = 0


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, plan: Plan) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.plan = plan
        self.seen: dict[int, tuple[object, ...]] = {}

    def persistent_id(self, obj: object) -> tuple[object, ...] | None:
        if not isinstance(obj, torch.Tensor):
            return None
        known = self.seen.get(id(obj))
        if known is not None:
            return known
        tensor = _plain(obj)
        stored = Stored(
            align(self.plan.data_bytes), tensor.dtype, tuple(tensor.shape), str(tensor.device)
        )
        self.plan.data_bytes = stored.offset + stored.nbytes
        self.plan.tensors.append((tensor, stored))
        ref = (
            "t",
            stored.offset,
            str(stored.dtype).removeprefix("torch."),
            stored.shape,
            stored.device,
        )
        self.seen[id(obj)] = ref
        return ref


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
    """The skeleton and the tensors of `state`; CheckpointError for a value that cannot be
    pickled (nothing is written then)."""
    result = Plan(b"")
    buffer = io.BytesIO()
    try:
        _Pickler(buffer, result).dump(state)
    except CheckpointError:
        raise
    except Exception as error:  # pickle raises what the object's reduce raises
        raise CheckpointError(
            f"the state dict cannot be snapshotted: {type(error).__name__}: {error} "
            "(every value that is not a tensor must pickle)"
        ) from error
    result.skeleton = buffer.getvalue()
    return result


def tensor_in(buffer: Any, data_offset: int, stored: Stored) -> torch.Tensor:
    """The snapshot's bytes of `stored` as a CPU tensor over `buffer` (no copy)."""
    if stored.nbytes == 0:
        return torch.empty(stored.shape, dtype=stored.dtype)
    raw = torch.frombuffer(
        buffer, dtype=torch.uint8, count=stored.nbytes, offset=data_offset + stored.offset
    )
    return raw.view(stored.dtype).view(stored.shape)


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Stored:
        tag, offset, dtype_name, shape, device = pid
        dtype = getattr(torch, dtype_name, None)
        if tag != "t" or not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"the snapshot names no tensor type {dtype_name!r}")
        return Stored(int(offset), dtype, tuple(int(s) for s in shape), str(device))


def skeleton_of(data: bytes) -> Any:
    """The state dict a snapshot holds, with Stored where its tensors are. The snapshot was
    written by a rank of this job into the daemon's private directory: it is this job's own
    state, read as torch.load reads a checkpoint the job wrote."""
    return _Unpickler(io.BytesIO(data)).load()


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
        if isinstance(stored, tuple) and hasattr(stored, "_fields"):  # a named tuple
            return type(stored)(*(self.into(None, value) for value in stored))
        if isinstance(stored, (list, tuple)):
            return type(stored)(self.into(None, value) for value in stored)
        if isinstance(stored, dict):
            return {key: self.into(None, value) for key, value in stored.items()}
        return stored

    def _tensor(self, stored: Stored) -> torch.Tensor:
        if stored.offset < 0 or stored.offset + stored.nbytes > self.data_bytes:
            raise CheckpointError("the snapshot's tensor lies outside its data")
        return tensor_in(self.buffer, self.data_offset, stored)
