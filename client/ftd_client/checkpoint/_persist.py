"""Snapshots persisted to disk (--checkpoint-persist DIR): a thread of the rank writes every N-th
complete snapshot from the node's memory to DIR as torch.distributed.checkpoint files, and a job
that finds nothing in memory nor on a peer resumes from the newest step every rank holds there.

Layout: DIR/w<world>/step_<N>/rank_<r>, one complete DCP checkpoint per rank (its own .metadata;
its keys the state dict's, flattened as dcp.save flattens them) plus `ftd.skeleton` (the
snapshot's pickled structure, so that a restore gives back every key and value as saved: DCP
names an optimizer's int keys by their text). It is written into a hidden `.rank_<r>.tmp-<pid>`
beside it and renamed when whole, so a `rank_<r>` is always complete. Each rank keeps its newest
KEEP steps and removes its own older ones; a step it writes again (its history went back after a
restore) replaces the old one, and any newer one of the old history goes.

The snapshot is read from its slot file through a mapping of this thread's own (tensors are
views of it: no copy before DCP's own); while it is read the copy thread writes no snapshot into
that slot (it skips those saves), so the memory tier keeps the snapshot after the persisted one.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import re
import shutil
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ftd_client.checkpoint._agree import agreed_step
from ftd_client.checkpoint._plan import CheckpointError, Restorer, Stored, skeleton_of
from ftd_client.rank_setup import keep_stack_signal_off_this_thread
from ftd_client.snapshot_format import HEADER, decode_header

KEEP = 3
MAX_LISTED = 10_000
"""Entries read from a directory of DIR at most (a listing is bounded, whatever DIR holds)."""
SKELETON = "ftd.skeleton"
METADATA = ".metadata"
_LOCAL_SAVE = r"torch\.distributed is disabled, .* the intent is to save"
_STEP = re.compile(r"step_(0|[1-9][0-9]{0,15})")


def world_dir(directory: str | Path, world: int) -> Path:
    return Path(directory) / f"w{world}"


def steps_of(directory: Path, rank: int) -> list[int]:
    """The steps of `rank` complete in `directory` (a DIR/w<world>), oldest first: only
    `step_<digits>` directories holding a `rank_<r>` with DCP's metadata and the skeleton."""
    steps = []
    try:
        with os.scandir(directory) as entries:
            for entry in itertools.islice(entries, MAX_LISTED):
                name = _STEP.fullmatch(entry.name)
                if name is None or not entry.is_dir(follow_symlinks=False):
                    continue
                mine = Path(entry.path) / f"rank_{rank}"
                if (mine / METADATA).is_file() and (mine / SKELETON).is_file():
                    steps.append(int(name[1]))
    except OSError:
        return []
    return sorted(steps)


def doomed(held: list[int], written: int, keep: int = KEEP) -> list[int]:
    """The steps of a rank to remove once `written` is whole: every newer one (another
    history's) and all but the newest `keep` of the rest."""
    kept = sorted(s for s in held if s <= written)
    return sorted({s for s in held if s > written} | set(kept[: max(len(kept) - keep, 0)]))


class Counts(Protocol):
    """Where the persist thread counts (checkpoint.Stats)."""

    persisted: int
    persist_failed: int
    persist_s: float


@dataclass
class Work:
    path: str
    step: int
    world: int
    rank: int
    directory: str


class Persister:
    """One persist at a time, on a thread of its own; `offer` never waits."""

    def __init__(self, counts: Counts) -> None:
        self.counts = counts
        self.failing = False
        """The last persist failed: said once, until one succeeds."""
        self._cond = threading.Condition()
        self._work: Work | None = None
        self._thread: threading.Thread | None = None
        self.reading: str | None = None
        """The slot file being read: the copy thread writes nothing into it meanwhile."""

    def offer(self, work: Work) -> bool:
        """Persist `work` unless a persist is under way (False: skipped)."""
        with self._cond:
            if self.reading is not None:
                return False
            self.reading, self._work = work.path, work
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="ftd-checkpoint-persist", daemon=True
                )
                self._thread.start()
        return True

    def wait(self, timeout_s: float) -> bool:
        """True once no persist is under way (waited for up to `timeout_s`)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.reading is None, timeout_s)

    def _run(self) -> None:
        keep_stack_signal_off_this_thread()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._work is not None)
                work, self._work = self._work, None
            assert work is not None
            started = time.perf_counter()
            try:
                write(work)
                self.counts.persisted += 1
                self.failing = False
            except Exception as error:  # disk full, no permission: counted, never raised
                self.counts.persist_failed += 1
                if not self.failing:
                    self.failing = True
                    say(f"snapshot of step {work.step} not persisted: {type(error).__name__}: "
                        f"{error}"[:500])  # fmt: skip
            self.counts.persist_s = time.perf_counter() - started
            with self._cond:
                self.reading = None
                self._cond.notify_all()


def write(work: Work) -> None:
    """The snapshot in `work.path` as rank_<r> of DIR/w<world>/step_<N>, then the retention."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    warnings.filterwarnings("ignore", _LOCAL_SAVE, UserWarning)  # no_dist=True: as meant
    fd = os.open(work.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        view = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    base = world_dir(work.directory, work.world)
    step_dir = base / f"step_{work.step}"
    final = step_dir / f"rank_{work.rank}"
    tmp = step_dir / f".rank_{work.rank}.tmp-{os.getpid()}"
    try:
        header = decode_header(view[: HEADER.size], size)
        if (header.step, header.rank, header.world) != (work.step, work.rank, work.world):
            raise CheckpointError(f"the slot holds step {header.step} of rank {header.rank}")
        skeleton = view[header.skeleton_offset : header.skeleton_offset + header.skeleton_bytes]
        tree = Restorer(view, header.data_offset, header.data_bytes, copy=False).into(
            None, skeleton_of(skeleton)
        )
        shutil.rmtree(tmp, ignore_errors=True)
        step_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        dcp_save(tree, storage_writer=FileSystemWriter(tmp), no_dist=True)
        del tree
        _write_file(tmp / SKELETON, skeleton)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        with contextlib.suppress(BufferError):  # a view DCP still holds: freed with it
            view.close()
    shutil.rmtree(final, ignore_errors=True)  # another history's step of this number
    os.rename(tmp, final)
    with contextlib.suppress(OSError):
        _fsync_dir(step_dir)
    for step in doomed(steps_of(base, work.rank), work.step):
        remove(base, step, work.rank)


def remove(base: Path, step: int, rank: int) -> None:
    """This rank's checkpoint of `step` and what a killed write of it left, then the step's
    directory once it is empty (only one process is the rank at a time)."""
    step_dir = base / f"step_{step}"
    shutil.rmtree(step_dir / f"rank_{rank}", ignore_errors=True)
    left: list[str] = []
    with contextlib.suppress(OSError), os.scandir(step_dir) as entries:
        left = [e.path for e in itertools.islice(entries, MAX_LISTED) if _tmp_of(rank, e.name)]
    for path in left:
        shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        step_dir.rmdir()


def _tmp_of(rank: int, name: str) -> bool:
    return name.startswith(f".rank_{rank}.tmp-")


def _write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def restore_from(
    reply: dict[str, Any], state: dict[str, Any], rank: int, world: int, round_number: int
) -> int | None:
    """Memory and the peers hold nothing (the daemon's restore `reply`): fill `state` from the
    newest step every rank holds in --checkpoint-persist; that step, or None. In a job of
    several nodes every rank takes part (one whose daemon has no such directory holds no
    step), so no rank waits for one that never asks."""
    directory = reply.get("persist")
    if not reply.get("ok") or not (reply.get("agree") or isinstance(directory, str)):
        return None
    base = world_dir(directory, world) if isinstance(directory, str) else None
    held = steps_of(base, rank) if base is not None else []
    step = agreed_step(held, rank, world, round_number, kind="disk")
    if step is None or base is None:
        return None
    load(base / f"step_{step}" / f"rank_{rank}", state)
    return step


def load(path: Path, state: dict[str, Any]) -> None:
    """Fill `state` in place from the rank's checkpoint at `path`, as Restorer.into does."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    skeleton = skeleton_of((path / SKELETON).read_bytes())
    loaded: dict[str, Any] = {}
    _load_state_dict(  # as DCP's format_utils does: dcp.load would fill a copy of `loaded`
        loaded,
        storage_reader=FileSystemReader(path),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    tensors: dict[int, torch.Tensor] = {}
    _pair(skeleton, loaded, tensors)
    _Loaded(tensors).into(state, skeleton)


def _pair(stored: Any, loaded: Any, tensors: dict[int, torch.Tensor]) -> None:
    """Each tensor DCP gave back, by its place in the skeleton (DCP keys dicts by str(key))."""
    if isinstance(stored, Stored):
        if isinstance(loaded, torch.Tensor):
            tensors[stored.offset] = loaded
    elif isinstance(stored, dict) and isinstance(loaded, dict):
        for key, value in stored.items():
            if str(key) in loaded:
                _pair(value, loaded[str(key)], tensors)
    elif isinstance(stored, (list, tuple)) and isinstance(loaded, (list, tuple)):
        for value, other in zip(stored, loaded, strict=False):
            _pair(value, other, tensors)


class _Loaded(Restorer):
    def __init__(self, tensors: dict[int, torch.Tensor]) -> None:
        super().__init__(None, 0, 0)
        self.tensors = tensors

    def _tensor(self, stored: Stored) -> torch.Tensor:
        tensor = self.tensors.get(stored.offset)
        if tensor is None or tensor.shape != stored.shape or tensor.dtype != stored.dtype:
            raise CheckpointError("the persisted checkpoint lacks a tensor of its skeleton")
        return tensor


def say(message: str) -> None:
    print(f"ftd_client.checkpoint: {message}", file=sys.stderr)
