"""Snapshots persisted to disk (--checkpoint-persist DIR): a thread of the rank writes every N-th
complete snapshot from the node's memory to DIR as torch.distributed.checkpoint files, and a job
that finds nothing in memory nor on a peer resumes from the newest step every rank holds there.

Layout: DIR/w<world>/step_<N>/rank_<r>, one complete DCP checkpoint per rank (its own .metadata;
its keys the state dict's, flattened as dcp.save flattens them) plus `ftd.skeleton` (the
snapshot's structure in _skeleton.py's format, so that a restore gives back every key and value
as saved: DCP names an optimizer's int keys by their text) and `ftd.index` (where each tensor's
bytes are in DCP's files: a restore reads neither DCP's `.metadata` nor anything else that is
a pickle; _persist_load.py). Directories are 0700, files 0600. It is written into a hidden
`.rank_<r>.tmp-<pid>` beside it and renamed when whole, so a `rank_<r>` is always complete.
Each rank keeps its newest KEEP steps and removes its own older ones; a step it writes again
(its history went back after a restore) replaces the old one, and any newer one of the old
history goes.

The snapshot is read from its slot file through a mapping of this thread's own (tensors are
views of it: no copy before DCP's own); while it is read the copy thread writes no snapshot into
that slot (it skips those saves), so the memory tier keeps the snapshot after the persisted one.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import shutil
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ftd_client.checkpoint._disk import (
    DIR_MODE,
    INDEX,
    MAX_LISTED,
    SKELETON,
    check_dirs,
    make_private,
    steps_of,
    world_dir,
)
from ftd_client.checkpoint._errors import CheckpointError
from ftd_client.checkpoint._plan import Restorer, Stored, skeleton_of
from ftd_client.checkpoint._skeleton import encode
from ftd_client.rank_setup import keep_stack_signal_off_this_thread
from ftd_client.snapshot_format import HEADER, decode_header

KEEP = 3
_LOCAL_SAVE = r"torch\.distributed is disabled, .* the intent is to save"


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
                    reason = f"{type(error).__name__}: {error}"
                    say(f"snapshot of step {work.step} not persisted: {reason}"[:500])
            self.counts.persist_s = time.perf_counter() - started
            with self._cond:
                self.reading = None
                self._cond.notify_all()


def write(work: Work) -> None:
    """The snapshot in `work.path` as rank_<r> of DIR/w<world>/step_<N>, then the retention."""
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
        _private_dirs(Path(work.directory), base, step_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        os.mkdir(tmp, DIR_MODE)  # DCP's files get the umask's modes: nobody else reaches them
        writer = _metadata_keeping_writer(tmp)
        dcp_save(_listed(tree), storage_writer=writer, no_dist=True)
        del tree
        _write_file(tmp / SKELETON, skeleton)
        _write_file(tmp / INDEX, index_of(skeleton_of(skeleton), writer.metadata))
        make_private(tmp)
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


def _private_dirs(*made: Path) -> None:
    """DIR (the daemon made or checked it) and the directories below it, made 0700 where
    missing: each this user's only, never through a link."""
    for path in made:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, DIR_MODE)
        check_dirs(path)


def _listed(tree: Any) -> Any:
    """The tree DCP is given: tuples as lists (DCP pickles a tuple whole, tensors and all,
    where it walks a list); dicts and lists are this write's own, changed in place."""
    if isinstance(tree, tuple) and type(tree) is not torch.Size:
        return [_listed(value) for value in tree]
    if isinstance(tree, list | dict):
        for key, value in tree.items() if isinstance(tree, dict) else enumerate(tree):
            tree[key] = _listed(value)
    return tree


def _metadata_keeping_writer(path: Path) -> Any:
    """DCP's FileSystemWriter that keeps the metadata it wrote (where each tensor went)."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):  # type: ignore[misc]
        metadata: Any = None

        def finish(self, metadata: Any, results: Any) -> None:
            super().finish(metadata, results)
            self.metadata = metadata

    return Writer(path)


def index_of(skeleton: Any, metadata: Any) -> bytes:
    """Where DCP put each tensor of `skeleton` (its file, offset and length), by the tensor's
    offset in the snapshot; CheckpointError if DCP put one where this cannot say."""
    places: dict[tuple[object, ...], Stored] = {}
    _places(skeleton, (), places)
    index: dict[int, tuple[str, int, int]] = {}
    for key, info in metadata.storage_data.items():
        path = (metadata.planner_data or {}).get(key.fqn)
        stored = places.get(tuple(path)) if path is not None else None
        if stored is not None and stored.nbytes and not info.transform_descriptors:
            index[stored.offset] = (str(info.relative_path), int(info.offset), int(info.length))
    missing = {s.offset for s in places.values() if s.nbytes} - index.keys()
    if missing:
        raise CheckpointError(
            f"DCP stored {len(missing)} tensors under keys that do not name one place of the "
            "state (keys such as 1 and '1' in one dict)"
        )
    return encode(index, _no_tensor)


def _places(
    stored: Any, path: tuple[object, ...], places: dict[tuple[object, ...], Stored]
) -> None:
    """Each tensor by its path as DCP names it (a dict's keys by their text, a list's items
    by their index)."""
    if isinstance(stored, Stored):
        places[path] = stored
    elif isinstance(stored, dict):
        for key, value in stored.items():
            _places(value, (*path, str(key)), places)
    elif isinstance(stored, list | tuple) and type(stored) is not torch.Size:
        for number, value in enumerate(stored):
            _places(value, (*path, number), places)


def _no_tensor(_: object) -> Stored:
    raise CheckpointError("an index holds no tensor")


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


def say(message: str) -> None:
    print(f"ftd_client.checkpoint: {message}", file=sys.stderr)
