"""The replicas this node keeps of its predecessor's snapshots (and those a replacement node
pulled): files in a private subdirectory of the memory directory, one per (global rank, world,
step), counted against the same --checkpoint-memory as the node's own snapshots.

A replica is kept only once whole: its frame verified (replica_frame.py) and its snapshot header
describing exactly the rank, world and step the frame names (the same check as a rank's own
snapshot). Per rank the newest three are kept: the two newest the sender knows acknowledged,
and one whose acknowledgement may not have reached it (ledger.py says why that is enough).

A replica being sent to a pulling peer stays open until its answer is read; one dropped
meanwhile (trimmed, replaced) is still memory: its bytes count against the budget until its
file is closed, and the sender stops at its next chunk (`holds`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftd_client.snapshot_format import SnapshotFormatError

from ftd.checkpoint.holder import read_header
from ftd.checkpoint.ledger import Ledger
from ftd.checkpoint.replica_frame import FrameError, FrameHeader

SUBDIRECTORY = "replicas"
NEWEST_KEPT = 3
MAX_RANKS = 65536


@dataclass(frozen=True)
class Replica:
    rank: int
    world: int
    step: int
    path: Path
    nbytes: int
    sha256: str


def kept_steps(steps: Iterable[int]) -> set[int]:
    """The replicas of one rank that stay: the newest three."""
    return set(sorted(steps)[-NEWEST_KEPT:])


class Incoming:
    """A replica's body being received: written to a file of its own while it is hashed."""

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path = path
        self.nbytes = nbytes
        self.received = 0
        self._hash = hashlib.sha256()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)

    def write(self, chunk: bytes) -> None:
        """Blocking: called in a thread."""
        self._hash.update(chunk)
        view = memoryview(chunk)
        while view:
            view = view[os.write(self._fd, view) :]
        self.received += len(chunk)

    def finish(self) -> str:
        os.close(self._fd)
        self._fd = -1
        return self._hash.hexdigest()

    def discard(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(OSError):
            self.path.unlink()


class ReplicaStore:
    def __init__(self, memory_dir: Path, ledger: Ledger) -> None:
        self.directory = memory_dir / SUBDIRECTORY
        self.directory.mkdir(mode=0o700)
        self.ledger = ledger
        self._held: dict[tuple[int, int], dict[int, Replica]] = {}
        self._rounds: dict[tuple[int, int], int] = {}
        """The newest round whose replica of (rank, world) was kept: an older one is refused."""
        self._incoming_bytes = 0
        self._reading: dict[Path, int] = {}
        """Replicas open for a pulling peer, and how many times."""
        self._dropped_open: dict[Path, int] = {}
        """The bytes of replicas dropped while still open: memory until they are closed."""
        self._names = itertools.count()
        self.kept = 0

    @property
    def held_bytes(self) -> int:
        return sum(r.nbytes for steps in self._held.values() for r in steps.values())

    def room(self, nbytes: int) -> bool:
        """Whether a replica of `nbytes` fits the budget beside what this node holds."""
        used = self.ledger.reserved_bytes + self.ledger.replica_bytes
        return used + nbytes <= self.ledger.budget_bytes

    def incoming(self, nbytes: int) -> Incoming:
        """A file for a replica's body, its bytes reserved until it is kept or discarded."""
        self._incoming_bytes += nbytes
        self._account()
        return Incoming(self.directory / f"incoming.{next(self._names)}", nbytes)

    def release(self, incoming: Incoming) -> None:
        self._incoming_bytes -= incoming.nbytes
        self._account()

    def check(self, header: FrameHeader, incoming: Incoming, digest: str) -> None:
        """FrameError unless the received body is whole the snapshot the signed header names.
        Blocking (reads the file's header)."""
        if digest != header.body_sha256 or incoming.received != header.body_bytes:
            raise FrameError("corrupt", "the body is not the one the signed header names")
        try:
            found = read_header(incoming.path)
        except (OSError, SnapshotFormatError) as error:
            raise FrameError("corrupt", f"not a snapshot: {error}") from None
        if (found.step, found.rank, found.world) != (header.step, header.rank, header.world):
            raise FrameError(
                "corrupt",
                f"the snapshot is step {found.step} of rank {found.rank} of {found.world}, "
                f"not step {header.step} of rank {header.rank} of {header.world}",
            )

    def keep(self, header: FrameHeader, incoming: Incoming) -> Replica:
        """The received body, `check`ed whole, kept as the replica of (rank, world, step);
        FrameError (`stale`) for a round older than one kept. On the loop: the books are its."""
        key = (header.rank, header.world)
        seen = self._rounds.get(key, 0)
        if header.round < seen:
            raise FrameError("stale", f"round {header.round}, after round {seen} was seen")
        if header.round > seen:  # the job may have gone back: a newer step of before is not this
            for step in [s for s in self._held.get(key, {}) if s >= header.step]:
                self._drop(self._held[key].pop(step))
        if key not in self._held and len(self._held) >= MAX_RANKS:
            raise FrameError("over_budget", f"replicas of {MAX_RANKS} ranks are held already")
        path = self.directory / f"rank{header.rank}.w{header.world}.s{header.step}"
        replaced = self._held.get(key, {}).pop(header.step, None)
        if replaced is not None:
            self._drop(replaced)
        os.replace(incoming.path, path)
        replica = Replica(
            header.rank, header.world, header.step, path, header.body_bytes, header.body_sha256
        )
        self._held.setdefault(key, {})[header.step] = replica
        self._rounds[key] = header.round
        self.kept += 1
        self.trim()
        return replica

    def newest(self, rank: int, world: int, limit: int) -> list[Replica]:
        """The replicas of `rank` in a job of `world` ranks, newest first."""
        found = self._held.get((rank, world), {}).values()
        return sorted(found, key=lambda r: r.step, reverse=True)[:limit]

    def trim(self) -> None:
        """Drop each rank's replicas but the newest three."""
        for steps in self._held.values():
            kept = kept_steps(steps)
            for step in [s for s in steps if s not in kept]:
                self._drop(steps.pop(step))
        self._account()

    def holds(self, replica: Replica) -> bool:
        """Whether `replica` is still kept (not trimmed or replaced since it was listed)."""
        return self._held.get((replica.rank, replica.world), {}).get(replica.step) is replica

    @contextlib.contextmanager
    def reading(self, replica: Replica) -> Iterator[int | None]:
        """`replica`'s file open for a pulling peer (None: dropped meanwhile); counted against
        the budget until closed even if it is dropped meanwhile."""
        try:
            fd = os.open(replica.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            yield None
            return
        self._reading[replica.path] = self._reading.get(replica.path, 0) + 1
        try:
            yield fd
        finally:
            os.close(fd)
            left = self._reading.pop(replica.path) - 1
            if left:
                self._reading[replica.path] = left
            elif self._dropped_open.pop(replica.path, None) is not None:
                self._account()

    def _drop(self, replica: Replica) -> None:
        if replica.path in self._reading:
            self._dropped_open[replica.path] = replica.nbytes
        with contextlib.suppress(OSError):
            replica.path.unlink()

    def view(self) -> dict[str, Any]:
        return {
            "held": sum(len(steps) for steps in self._held.values()),
            "held_bytes": self.held_bytes,
        }

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        self._held.clear()
        self._account()

    def _account(self) -> None:
        dropped_open = sum(self._dropped_open.values())
        self.ledger.hold_replicas(self.held_bytes + self._incoming_bytes + dropped_open)
