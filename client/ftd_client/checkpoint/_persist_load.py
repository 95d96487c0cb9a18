"""A restore from --checkpoint-persist DIR (docs/checkpoint.md "Persistence to disk"): the ranks
agree on the newest step all of them hold, each reads its own checkpoint of it, and only once
every rank has read its own does any of them fill its state. A step that a rank cannot read (a
file cut short or corrupt, a skeleton that is not one, an entry that is a link or another
user's) is named in one warning and refused by that rank; the ranks then agree again, on the
next older step all of them hold. Nothing of it escapes `checkpoint.load`.

What is read is data only: the skeleton and the index (_skeleton.py's decoder), and each
tensor's bytes, taken raw from the uncompressed member of the torch.save archive DCP wrote for
it (its CRC checked). Neither DCP's `.metadata` nor its archives' `data.pkl` (pickles) is
ever unpickled.
"""

from __future__ import annotations

import io
import os
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ftd_client.checkpoint._agree import MAX_STEPS, agreed_step
from ftd_client.checkpoint._disk import (
    INDEX,
    SKELETON,
    check_dirs,
    open_private,
    read_private,
    steps_of,
    world_dir,
)
from ftd_client.checkpoint._errors import CheckpointError
from ftd_client.checkpoint._plan import Restorer, Stored, skeleton_of
from ftd_client.checkpoint._skeleton import MAX_BYTES, decode
from ftd_client.snapshot_format import MAX_SNAPSHOT_BYTES

MAX_ROUNDS = 2 * MAX_STEPS + 2
"""Rounds of agreement at most: each one that confirms nothing agrees on an older step."""
_MEMBER_TAIL = "/data/0"
_CHUNK = 1 << 24


def restore_from(
    reply: dict[str, Any], state: dict[str, Any], rank: int, world: int, round_number: int
) -> int | None:
    """Memory and the peers hold nothing (the daemon's restore `reply`): fill `state` from the
    newest step every rank holds and could read in --checkpoint-persist; that step, or None.
    In a job of several nodes every rank takes part (one whose daemon has no such directory
    holds no step), so no rank waits for one that never asks."""
    directory = reply.get("persist")
    if not reply.get("ok") or not (reply.get("agree") or isinstance(directory, str)):
        return None
    base = world_dir(directory, world) if isinstance(directory, str) else None
    held = steps_of(base, rank) if base is not None else []
    refused: set[int] = set()
    ready: tuple[int, Loaded] | None = None
    for number in range(MAX_ROUNDS):
        mine = [step for step in held if step not in refused]
        step = agreed_step(mine, rank, world, round_number, kind=f"disk/{number}")
        if step is None or base is None:
            return None
        if ready is not None and ready[0] == step:  # every rank read it: none refused it
            ready[1].into(state)
            return step
        ready = None
        try:
            ready = (step, read(Path(str(directory)), base, step, rank))
        except Exception as error:  # whatever the files hold: this step is not restored
            refused.add(step)
            say(f"persisted step {step} of rank {rank} skipped: {_reason(error)}")
    return None


def _reason(error: Exception) -> str:
    if isinstance(error, CheckpointError):
        return str(error)[:300]
    return f"{type(error).__name__}: {error}"[:300]


@dataclass
class Loaded:
    """A rank's checkpoint of one step, read whole: its skeleton and its tensors."""

    skeleton: Any
    tensors: dict[int, torch.Tensor]

    def into(self, state: dict[str, Any]) -> None:
        """Fill `state` in place, as Restorer.into does from memory."""
        _FromDisk(self.tensors).into(state, self.skeleton)


def load(path: Path, state: dict[str, Any]) -> None:
    """Fill `state` in place from the rank's checkpoint at `path` (DIR/w<world>/step_<N>/
    rank_<r>); CheckpointError (or what the files made fail) if it cannot be read."""
    step_dir = path.parent
    name = step_dir.name.removeprefix("step_")
    rank = path.name.removeprefix("rank_")
    if not (name.isdigit() and rank.isdigit()):
        raise CheckpointError(f"{path} is not DIR/w<world>/step_<N>/rank_<r>")
    read(step_dir.parent.parent, step_dir.parent, int(name), int(rank)).into(state)


def read(directory: Path, base: Path, step: int, rank: int) -> Loaded:
    """Rank `rank`'s checkpoint of `step` in `base` (DIR/w<world>), every entry this user's own."""
    step_dir = base / f"step_{step}"
    rank_dir = step_dir / f"rank_{rank}"
    check_dirs(directory, base, step_dir, rank_dir)
    skeleton = skeleton_of(read_private(rank_dir / SKELETON, MAX_BYTES))
    index = _index(decode(read_private(rank_dir / INDEX, MAX_BYTES)))
    wanted: dict[int, Stored] = {}
    _tensors_of(skeleton, wanted)
    files: dict[str, int] = {}
    tensors: dict[int, torch.Tensor] = {}
    try:
        for offset, stored in wanted.items():
            place = index.get(offset)
            if place is None:
                raise CheckpointError(f"{rank_dir / INDEX} names no place of a tensor")
            name, start, length = place
            if name not in files:
                files[name] = open_private(rank_dir / name)
            tensors[offset] = _tensor_at(files[name], start, length, stored)
    finally:
        for fd in files.values():
            os.close(fd)
    return Loaded(skeleton, tensors)


def _index(value: Any) -> dict[int, tuple[str, int, int]]:
    """The index's entries, each checked: a tensor's offset -> (a DCP file's plain name, the
    offset and length of the tensor's archive in it)."""
    if not isinstance(value, dict):
        raise CheckpointError("the index is not a dict")
    for key, place in value.items():
        if not (
            type(key) is int
            and type(place) is tuple
            and len(place) == 3
            and type(place[0]) is str
            and place[0].endswith(".distcp")
            and "/" not in place[0]
            and not place[0].startswith(".")
            and all(type(n) is int and 0 <= n <= MAX_SNAPSHOT_BYTES for n in place[1:])
        ):
            raise CheckpointError(f"the index holds an entry that is not a place: {key!r:.40}")
    return value


def _tensors_of(stored: Any, wanted: dict[int, Stored]) -> None:
    """Each tensor of the skeleton with bytes, by its offset (one per offset)."""
    stack = [stored]
    while stack:
        item = stack.pop()
        if isinstance(item, Stored):
            if item.nbytes:
                wanted.setdefault(item.offset, item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)


def _tensor_at(fd: int, start: int, length: int, stored: Stored) -> torch.Tensor:
    """The tensor whose archive DCP wrote at [start, start + length) of the file: the bytes of
    its one storage, uncompressed, exactly as many as the skeleton says, CRC checked."""
    if start + length > os.fstat(fd).st_size or stored.nbytes > length:
        raise CheckpointError("a tensor's archive lies outside its file, or is too short")
    archive = os.pread(fd, length, start)
    if len(archive) != length:
        raise CheckpointError("a DCP file changed while it was read")
    with zipfile.ZipFile(io.BytesIO(archive)) as bundle:
        storages = [m for m in bundle.infolist() if "/data/" in m.filename]
        if len(storages) != 1 or not storages[0].filename.endswith(_MEMBER_TAIL):
            raise CheckpointError("a tensor's archive does not hold one storage")
        member = storages[0]
        if member.compress_type != zipfile.ZIP_STORED or member.file_size != stored.nbytes:
            raise CheckpointError(
                f"a tensor's storage holds {member.file_size} bytes, not {stored.nbytes}"
            )
        raw = torch.empty(stored.nbytes, dtype=torch.uint8)
        into, got = memoryview(raw.numpy()), 0
        with bundle.open(member) as data:  # its CRC checked once its last byte is read
            while got < stored.nbytes:
                chunk = data.read(min(stored.nbytes - got, _CHUNK))
                if not chunk:
                    break
                into[got : got + len(chunk)] = chunk
                got += len(chunk)
            if got != stored.nbytes or data.read(1):
                raise CheckpointError("a tensor's storage is cut short")
    return raw.view(stored.dtype).view(stored.shape)


class _FromDisk(Restorer):
    def __init__(self, tensors: dict[int, torch.Tensor]) -> None:
        super().__init__(None, 0, 0)
        self.tensors = tensors

    def _tensor(self, stored: Stored) -> torch.Tensor:
        if not stored.nbytes:
            return torch.empty(stored.shape, dtype=stored.dtype)
        tensor = self.tensors.get(stored.offset)
        if tensor is None or tensor.shape != stored.shape or tensor.dtype != stored.dtype:
            raise CheckpointError("the persisted checkpoint lacks a tensor of its skeleton")
        return tensor


def say(message: str) -> None:
    print(f"ftd_client.checkpoint: {message}", file=sys.stderr)
