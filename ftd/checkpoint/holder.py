"""The node's memory tier for training state: a private directory on a tmpfs that the daemon
creates, the ranks' snapshots in it, and the answers to ftd_client.checkpoint's requests.

The directory outlives every rank and lives as long as the daemon's job: made at start (mode
0700, the file in the run directory names it so a daemon that was killed leaves nothing behind
past the next start), removed at the end. Ranks write their snapshots into the files it names
(one copy: their tensors straight into the mapped file) and read them back the same way; the
daemon decides which file each snapshot goes in (ledger.py), accounts every byte against
--checkpoint-memory, and counts a snapshot complete only when its rank says so and the file's
header describes exactly that snapshot (ftd_client/snapshot_format.py: the one thing of the
file the daemon reads).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ftd_client.checkpoint_messages import (
    CheckpointBegin,
    CheckpointDone,
    CheckpointPlace,
    CheckpointRestore,
    CheckpointSeen,
)
from ftd_client.snapshot_format import HEADER, SnapshotFormatError, decode_header
from ftd_client.wire import Message

from ftd.checkpoint.ledger import Grant, Ledger
from ftd.checkpoint.memory_dir import (
    DEFAULT_BASE,
    DIRECTORY_RECORD,
    auto_budget,
    open_slot,
    owner_prefix,
    remove_stale,
)
from ftd.checkpoint.restores import RestoreAccount
from ftd.checkpoint.spacing import SnapshotSpacing
from ftd.config.serve import ServeConfig
from ftd.config.shared_paths import PathRefused, prepare_private_dir
from ftd.status.event_kind import EventKind
from ftd.status.events import EventLog

log = logging.getLogger("ftd.checkpoint")

MULTI_NODE = (
    "DCP's files in the node's memory are for single-node jobs: this job spans several nodes "
    "(its metadata would be on one node only; use checkpoint.save, or DCP to a shared disk)"
)
DCP_DIRECTORY = "dcp"
"""Where checkpoint.MemoryWriter puts torch.distributed.checkpoint's files (one directory per
checkpoint id), in the same memory, freed with it."""
NOT_REPLICATED: dict[str, Any] = {"replica_lag_steps": None, "replica": None}
"""The status' replica fields of a node whose snapshots have no replica on a peer."""


class Replicas(Protocol):
    """The replicas on a peer node (replication.py), built with the holder, as it calls them."""

    async def start(self, host: str) -> None:
        """Serve the peers' replicas on `host` and push this node's to its successor."""

    async def close(self) -> None: ...

    def summary(self) -> dict[str, Any]:
        """This node's part of its published summary (its replica server, what it holds)."""
        ...

    def completed(self) -> None:
        """A snapshot is complete: maybe a newer step to copy to the peer."""

    def restoring(self, rank: int, world: int) -> bool:
        """This node holds nothing of `rank`: fetch it from the peers; True while that runs."""
        ...

    def view(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Persist:
    """--checkpoint-persist: the directory the ranks write every `every`-th snapshot to (their
    own torch.distributed.checkpoint files: the daemon never reads them)."""

    directory: Path
    every: int


@dataclass
class Counts:
    begun: int = 0
    completed: int = 0
    busy: int = 0
    """Slots asked for while both of the rank's slots were still needed (asked again later)."""
    refused: int = 0
    restored: int = 0
    bad_snapshots: int = 0


class CheckpointHolder:
    def __init__(
        self,
        run_dir: Path,
        budget_bytes: int | None,
        events: EventLog,
        multi_node: bool = False,
        replicas: Callable[[CheckpointHolder], Replicas] | None = None,
        base: Path = DEFAULT_BASE,
        persist: Persist | None = None,
        every: int | None = 1,
    ) -> None:
        self.run_dir = run_dir
        self.persist = persist
        self.base = base if base.is_dir() else run_dir
        self.events = events
        self.directory: Path | None = None
        self.ledger = Ledger(
            budget_bytes if budget_bytes is not None else auto_budget(self.base),
            agreement=multi_node,
        )
        self.counts = Counts()
        self.spacing = SnapshotSpacing(every)
        """--checkpoint-every, and how often the job fails (the ranks' auto interval)."""
        self.multi_node = multi_node
        """A job of several nodes: the ranks agree on the step to restore (ledger.py)."""
        self.replicas = replicas(self) if replicas is not None else None
        self.restores = RestoreAccount(self.spacing)
        """The steps the ranks' restores lost, and when the job was back where it had been."""
        self._refused_ranks: set[int] = set()
        """Ranks whose last snapshot was refused as too large: said once per episode."""

    @classmethod
    def serving(
        cls,
        config: ServeConfig,
        run_dir: Path,
        events: EventLog,
        replicas: Callable[[CheckpointHolder], Replicas] | None,
    ) -> CheckpointHolder:
        """The holder `ftd serve` runs with `config`."""
        directory = config.checkpoint_persist_dir
        persist = Persist(directory, config.checkpoint_persist_every) if directory else None
        return cls(
            run_dir,
            config.checkpoint_memory_bytes,
            events,
            config.multi_node,
            replicas,
            persist=persist,
            every=config.checkpoint_every,
        )

    async def serve_replicas(self, host: str) -> None:
        """Where the snapshots have replicas on a peer: serve the peers' on `host` (this node's
        address, once it reached the rendezvous)."""
        if self.replicas is not None:
            await self.replicas.start(host)

    async def close_replicas(self) -> None:
        if self.replicas is not None:
            await self.replicas.close()

    def replica_summary(self) -> dict[str, Any]:
        return self.replicas.summary() if self.replicas is not None else {}

    def start(self) -> None:
        """Make the memory directory; where it cannot be made (a full disk), the daemon goes on
        without a memory tier and says why once (the ranks' saves then do nothing). Likewise
        the persistence directory: without it, snapshots stay in memory only."""
        remove_stale(self.run_dir, self.base)
        self._make_persist()
        if self.ledger.budget_bytes == 0:  # --checkpoint-memory 0: no memory tier
            return
        try:
            self.directory = Path(tempfile.mkdtemp(prefix=owner_prefix(), dir=self.base))
            record = self.run_dir / DIRECTORY_RECORD
            fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as out:
                json.dump({"directory": str(self.directory)}, out)
        except OSError as error:
            log.error("no memory for snapshots (ftd_client.checkpoint): %s", error)
            self.close()
            return
        log.info(
            "snapshots are held in %s (--checkpoint-memory %d bytes)",
            self.directory,
            self.ledger.budget_bytes,
        )

    def _make_persist(self) -> None:
        if self.persist is None:
            return
        directory = self.persist.directory
        try:  # another user's directory would hand them the job's state and its next start
            prepare_private_dir(directory, "--checkpoint-persist directory")
        except PathRefused as refused:
            log.error("no persistence (--checkpoint-persist): %s", refused)
            self.persist = None
            return
        log.info("every %d-th snapshot is persisted to %s", self.persist.every, directory)

    def close(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            with contextlib.suppress(OSError):
                (self.run_dir / DIRECTORY_RECORD).unlink(missing_ok=True)
            self.directory = None

    def answer(self, global_rank: int, message: Message) -> dict[str, Any] | None:
        """The reply to one of a rank's checkpoint messages; None for one that has none."""
        if isinstance(message, CheckpointSeen):
            if message.restored:
                self._from_disk(global_rank, message.step)
            else:
                self.restores.reached(global_rank, message.step)
            return None
        if self.directory is None:
            return {"ok": False, "error": "the daemon holds no snapshots"}
        match message:
            case CheckpointPlace() if self.multi_node:
                return {"ok": False, "refused": "unsupported", "error": MULTI_NODE}
            case CheckpointPlace():
                return {"ok": True, "path": str(self.directory / DCP_DIRECTORY)}
            case CheckpointBegin(step=step, bytes=size, world=world, every=every):
                self.spacing.reported(global_rank, every)
                return self._begin(global_rank, step, size, world)
            case CheckpointDone(step=step, slot=slot):
                return self._done(global_rank, slot, step)
            case CheckpointRestore(world=world, step=step):
                return self._restore(global_rank, world, step)
        return None

    def view(self) -> dict[str, Any] | None:
        """The status' `checkpoint` (openapi.yaml NodeCheckpoint); None until a rank used it."""
        if not self.counts.begun and not self.counts.refused and self.restores.last_restore is None:
            return None
        return {
            "memory_bytes": self.ledger.reserved_bytes,
            "budget_bytes": self.ledger.budget_bytes,
            "newest_step": self.newest_step(),
            "steps_lost": self.restores.steps_lost,
            "last_restore": self.restores.last_restore,
            "persist_dir": str(self.persist.directory) if self.persist else None,
            "persist_every": self.persist.every if self.persist else None,
            **self.spacing.view(),
            **vars(self.counts),
            **(self.replicas.view() if self.replicas is not None else NOT_REPLICATED),
        }

    def newest_step(self) -> int | None:
        """The newest step every rank of the node holds complete (the job's checkpoint
        iteration, as far as this node knows: in a job of several nodes the ranks agree on the
        rest); None before one."""
        ranks = self.ledger.ranks()
        worlds = {s.world for r in ranks.values() for s in r.slots if s is not None}
        if self.multi_node:
            newest = [r.complete_steps(w) for w in worlds for r in ranks.values()]
            common = min((steps[-1] if steps else -1 for steps in newest), default=-1)
        else:
            common = max((self.ledger.common_step(w) or -1 for w in worlds), default=-1)
        return common if common >= 0 else None

    @property
    def budget_bytes(self) -> int:
        return self.ledger.budget_bytes

    def slot_path(self, global_rank: int, slot: int) -> Path:
        assert self.directory is not None
        return self.directory / f"rank{global_rank}.{slot}"

    def adopt(self, rank: int, world: int, step: int, path: Path) -> bool:
        """A snapshot of `rank` fetched from a peer (checked whole), kept as a complete one of
        this node's (oldest first: the ledger takes a newer step for the rank's history)."""
        decision = self.ledger.begin(rank, step, path.stat().st_size, world)
        if not isinstance(decision, Grant):
            log.warning("rank %d's snapshot of step %d from a peer: %s", rank, step, decision)
            return False
        os.replace(path, self.slot_path(rank, decision.slot))
        held = self.ledger.writing(rank, decision.slot, step)
        assert held is not None
        held.complete = True
        return True

    def _begin(self, rank: int, step: int, nbytes: int, world: int) -> dict[str, Any]:
        if rank >= world:
            return {"ok": False, "error": f"rank {rank} is not in a world of {world}"}
        decision = self.ledger.begin(rank, step, nbytes, world)
        if isinstance(decision, Grant):
            self.counts.begun += 1
            self.restores.reached(rank, step)
            self._refused_ranks.discard(rank)
            path = self.slot_path(rank, decision.slot)
            grant = {"ok": True, "slot": decision.slot, "path": str(path), **self._policy()}
            if self.persist is not None and step % self.persist.every == 0:
                grant["persist"] = str(self.persist.directory)
            return grant
        if decision.reason == "busy":
            self.counts.busy += 1
        else:
            self.counts.refused += 1
            if rank not in self._refused_ranks:
                self._refused_ranks.add(rank)
                log.warning(
                    "rank %d's snapshot of step %d refused: %s", rank, step, decision.detail
                )
                self.events.emit_for_rank(
                    rank,
                    EventKind.CHECKPOINT_REFUSED,
                    global_rank=rank,
                    step=step,
                    bytes=nbytes,
                    reason=decision.detail,
                )
        return {"ok": False, "refused": decision.reason, "error": decision.detail}

    def _done(self, rank: int, slot: int, step: int) -> dict[str, Any]:
        held = self.ledger.writing(rank, slot, step)
        if held is None:
            return {"ok": False, "error": f"slot {slot} is not being written with step {step}"}
        try:
            header = read_header(self.slot_path(rank, slot))
            if (header.step, header.rank, header.world) != (step, rank, held.world):
                raise SnapshotFormatError(f"it holds step {header.step} of rank {header.rank}")
        except (OSError, SnapshotFormatError) as error:
            self.counts.bad_snapshots += 1
            return {"ok": False, "error": f"the snapshot of step {step} is not whole: {error}"}
        held.complete = True
        self.counts.completed += 1
        if self.replicas is not None:
            self.replicas.completed()
        return {"ok": True}

    def _from_disk(self, rank: int, step: int) -> None:
        """A rank restored `step` from --checkpoint-persist (memory and replicas held none)."""
        lost = self.restores.restored(step, None, None, "disk") if self.restores.counts() else None
        self.events.emit_for_rank(
            rank,
            EventKind.CHECKPOINT_RESTORED,
            global_rank=rank,
            step=step,
            steps_lost=lost,
            source="disk",
        )

    def _restore(self, rank: int, world: int, agreed: int | None) -> dict[str, Any]:
        self.restores.restore_asked_at = time.time()
        if self.multi_node and agreed is None:  # the ranks agree first, on what they hold
            slots = self.ledger.ranks().get(rank)
            steps = slots.complete_steps(world) if slots else []
            if not steps and self.replicas is not None and self.replicas.restoring(rank, world):
                return {"ok": True, "pending": True}  # asked again once the peers answered
            return {"ok": True, "agree": True, "steps": steps, **self._persist_reply()}
        found = self.ledger.restore(rank, world, agreed) if rank < world else None
        step = None if found is None else found[0]
        self.counts.restored += found is not None
        lost = None
        if step is not None and self.restores.counts():  # the first after the failure
            newest = self.ledger.newest_seen(world)
            lost = self.restores.restored(step, world, newest, "memory")
        self.events.emit_for_rank(
            rank, EventKind.CHECKPOINT_RESTORED, global_rank=rank, step=step, steps_lost=lost
        )
        if found is None:
            return {"ok": True, "step": None, **self._persist_reply(), **self._policy()}
        path = str(self.slot_path(rank, found[1]))
        return {
            "ok": True,
            "step": step,
            "path": path,
            **self._persist_reply(),
            **self._policy(),
        }

    def _policy(self) -> dict[str, Any]:
        """--checkpoint-every's policy as the ranks learn it, with the steps they always take
        (those --checkpoint-persist writes)."""
        persisted = {} if self.persist is None else {"persist_every": self.persist.every}
        return self.spacing.reply() | persisted

    def _persist_reply(self) -> dict[str, str]:
        """Where the ranks look when neither memory nor a peer holds a snapshot."""
        return {} if self.persist is None else {"persist": str(self.persist.directory)}


def read_header(path: Path) -> Any:
    fd = open_slot(path)
    try:
        return decode_header(os.pread(fd, HEADER.size, 0), os.fstat(fd).st_size)
    finally:
        os.close(fd)
