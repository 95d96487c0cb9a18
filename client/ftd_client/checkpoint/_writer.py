"""The rank's side of the memory tier: `save` schedules a snapshot and returns; a thread copies
it into the node's memory while the next step computes; `load` reads one back.

What the copy may overlap: the tensors an optimizer owns (its parameters and its state) change
only in `optimizer.step`, so a global pre-step hook waits for the copy before any optimizer
changes them; they are copied once, from the training's own tensors. Every other tensor (buffers
a forward updates, counters, RNG states) is cloned by `save` itself, since anything may change
it next. Hence the training waits only for its own copy, and only when the step before the
optimizer's took less time than the copy.

Slots are the daemon's to give (ftd/checkpoint/ledger.py). When both of the rank's slots may
still be needed (a peer's copy of the previous step is not done yet), the thread asks again,
backing off, until the optimizer's next step: then that save is skipped, never waited for.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ftd_client.checkpoint._agree import agreed_step
from ftd_client.checkpoint._link import CheckpointLink
from ftd_client.checkpoint._persist import Persister, Work
from ftd_client.checkpoint._persist_load import restore_from
from ftd_client.checkpoint._plan import (
    CheckpointError,
    Restorer,
    Stored,
    plan,
    skeleton_of,
    tensor_in,
)
from ftd_client.checkpoint._spacing import Spacing
from ftd_client.checkpoint._stats import Stats
from ftd_client.checkpoint_messages import (
    CheckpointBegin,
    CheckpointDone,
    CheckpointRestore,
    CheckpointSeen,
)
from ftd_client.rank_setup import keep_stack_signal_off_this_thread
from ftd_client.snapshot_format import HEADER, HEADER_BYTES, Header, decode_header, layout

log = logging.getLogger("ftd_client.checkpoint")

RESERVE_QUANTUM = 1 << 20
"""A snapshot's file grows in MiB steps, so a skeleton a few bytes longer reuses it."""
RETRY_FIRST_S = 0.001
RETRY_MAX_S = 0.016
EXIT_WAIT_S = 60.0
RESTORE_TIMEOUT_S = 120.0
PENDING_POLL_S = 0.05
_NO_HEADER = bytes(8)


@dataclass
class _Job:
    step: int
    header: Header
    skeleton: bytes
    tensors: list[tuple[torch.Tensor, Stored]]
    size: int
    save_s: float = 0.0
    """The time `save` itself took (what the training spent scheduling it)."""
    state: str = "waiting"  # waiting -> copying -> done, or waiting -> canceled
    slot: int = -1
    path: str = ""
    persist: str = ""
    """The directory the daemon asked this snapshot to be persisted to, once complete."""
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)
    asking: threading.Lock = field(default_factory=threading.Lock)
    """Held while a slot is asked for (by the thread, or by the training settling it)."""


class Checkpointer:
    def __init__(self, link: CheckpointLink | None, rank: int, world: int) -> None:
        self.link = link
        self.rank = rank
        self.world = world
        self.stats = Stats()
        self.spacing = Spacing()
        self.last_error: str | None = None
        self._loads = 0
        self.disabled: str | None = None
        """Why the daemon takes no snapshot of this job (a job of several nodes, so far)."""
        self._job: _Job | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._maps: dict[str, tuple[int, mmap.mmap]] = {}
        self._persister = Persister(self.stats)
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._hook = register_optimizer_step_pre_hook(self._before_step)

    # -- the training's calls -------------------------------------------------------------

    def save(self, state: dict[str, Any], step: int) -> bool:
        if not self.spacing.due(step):
            self.stats.spaced += 1
            if self.link is not None and not self.disabled:  # the daemon's steps lost, redo
                self.link.notify(CheckpointSeen(step))
            return False
        started = time.perf_counter()
        self.settle()
        if self.link is None or self.disabled:
            self.stats.skipped += 1
            return False
        snapshot = plan(state)
        guarded = self._guarded_storages()
        tensors = [
            (t if t.untyped_storage().data_ptr() in guarded else t.clone(), stored)
            for t, stored in snapshot.tensors
        ]
        header = layout(step, self.world, self.rank, len(snapshot.skeleton), snapshot.data_bytes)
        size = -(-header.total_bytes // RESERVE_QUANTUM) * RESERVE_QUANTUM
        job = _Job(step, header, snapshot.skeleton, tensors, size)
        self._begin(job)
        job.save_s = time.perf_counter() - started
        if job.state == "failed":
            raise CheckpointError(job.error)
        if job.state == "canceled":
            return False
        with self._cond:
            self._job = job
            self._cond.notify_all()
        self._start_thread()
        return True

    def load(self, state: dict[str, Any]) -> int | None:
        if not isinstance(state, dict):
            raise CheckpointError("checkpoint.load fills a dict in place")
        self.settle()
        if self.link is None:
            return None
        reply = self._ask_restore(CheckpointRestore(self.world))
        if reply.get("ok") and reply.get("agree"):
            steps = reply.get("steps")
            held = [s for s in steps if isinstance(s, int)] if isinstance(steps, list) else []
            self._loads += 1
            step = agreed_step(held, self.rank, self.world, self._loads)
            if step is None:  # in no rank's memory: every rank looks in --checkpoint-persist
                return self._load_persisted(state, reply)
            reply = self._ask_restore(CheckpointRestore(self.world, step))
            reply.pop("persist", None)  # the ranks agreed on a step in memory: none looks on disk
        self.spacing.learn(reply)
        if not reply.get("ok") or reply.get("step") is None:
            return self._load_persisted(state, reply)
        started = time.perf_counter()
        step = int(reply["step"])
        fd = os.open(str(reply["path"]), os.O_RDONLY | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            view = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        try:
            header = decode_header(view[: HEADER.size], size)
            if (header.step, header.rank, header.world) != (step, self.rank, self.world):
                raise CheckpointError(
                    f"the daemon's snapshot is step {header.step} of rank "
                    f"{header.rank}, not step {step} of rank {self.rank}"
                )
            stored = skeleton_of(
                view[header.skeleton_offset : header.skeleton_offset + header.skeleton_bytes]
            )
            Restorer(view, header.data_offset, header.data_bytes).into(state, stored)
        finally:
            with contextlib.suppress(BufferError):
                view.close()
        self.stats.restore_s = time.perf_counter() - started
        return step

    def _load_persisted(self, state: dict[str, Any], reply: dict[str, Any]) -> int | None:
        started = time.perf_counter()
        self._loads += 1
        step = restore_from(reply, state, self.rank, self.world, self._loads)
        if step is not None:
            self.stats.restore_s = time.perf_counter() - started
            if self.link is not None:  # the daemon's restore, steps lost and redo
                self.link.notify(CheckpointSeen(step, restored=True))
        return step

    def _ask_restore(self, message: CheckpointRestore) -> dict[str, Any]:
        """The daemon's answer, waited for: a rank that went on without it (from step 0 while
        its peers restore) would train apart from them, silently."""
        assert self.link is not None
        deadline = time.monotonic() + RESTORE_TIMEOUT_S
        while True:  # `pending`: the daemon fetches this rank's snapshots from a peer first
            left = deadline - time.monotonic()
            reply = self.link.request(message, timeout_s=left) if left > 0 else None
            if reply is None:
                raise CheckpointError(
                    f"the node's daemon did not answer which snapshot to restore in "
                    f"{RESTORE_TIMEOUT_S:.0f} s (the rank fails rather than train apart from "
                    "its peers)"
                )
            if not reply.get("pending"):
                return reply
            time.sleep(PENDING_POLL_S)

    def settle(self, patience_s: float = 0.0, persisted: bool = False) -> None:
        """Before the saved tensors may change: a save still waiting for a slot asks once more
        (the peers' copies are done by now in a job whose ranks meet in collectives every
        step) and is skipped if refused again; a copy under way is waited for. With
        `patience_s` (wait(), the end of the script: no next step comes to supersede it) it
        asks again for that long before it gives up; `persisted`: then waits as long for the
        write to --checkpoint-persist under way."""
        if persisted:
            self.settle(patience_s)
            self._persister.wait(patience_s)
            return
        job = self._job
        if job is None or job.done.is_set():
            return
        started = time.perf_counter()
        delay, deadline = RETRY_FIRST_S, time.monotonic() + patience_s
        with job.asking:
            while job.state == "waiting":
                self._begin(job)
                if job.state == "waiting" and time.monotonic() < deadline:
                    time.sleep(delay)
                    delay = min(delay * 2, RETRY_MAX_S)
                    continue
                if job.state != "copying":
                    job.state = "canceled"
                    self.stats.skipped += 1
                    job.done.set()
                    return
        job.done.wait()
        self.stats.waited_s += time.perf_counter() - started

    def close(self, timeout_s: float = EXIT_WAIT_S) -> None:
        """The last save completes (so the newest snapshot is the last step), then the hook
        goes; bounded, as a peer that died never finishes its copy."""
        job = self._job
        if job is not None and not job.done.is_set():
            waiter = threading.Thread(target=self.settle, args=(timeout_s, True), daemon=True)
            waiter.start()
            waiter.join(timeout_s)
        else:
            self._persister.wait(timeout_s)
        self._hook.remove()

    def _disable(self, reason: str) -> None:
        """The daemon holds no snapshots of this job: every later save is a no-op (said once)."""
        if self.disabled is None:
            self.disabled = reason[:500]
            print(f"ftd_client.checkpoint: saves do nothing: {self.disabled}", file=sys.stderr)

    # -- the copying thread -----------------------------------------------------------------

    def _before_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self._optimizers.add(optimizer)
        self.settle()

    def _guarded_storages(self) -> set[int]:
        guarded: set[int] = set()
        for optimizer in list(self._optimizers):
            for group in optimizer.param_groups:
                guarded.update(p.untyped_storage().data_ptr() for p in group["params"])
            for state in optimizer.state.values():
                guarded.update(
                    v.untyped_storage().data_ptr()
                    for v in state.values()
                    if isinstance(v, torch.Tensor)
                )
        guarded.discard(0)
        return guarded

    def _begin(self, job: _Job) -> bool:
        """Ask for a slot once: True when granted (job copying), else the job is waiting (ask
        again from the thread), failed or canceled."""
        assert self.link is not None
        reply = self.link.request(
            CheckpointBegin(job.step, job.size, self.world, self.stats.interval_steps)
        )
        if reply is None:
            job.state = "canceled"
            self.stats.skipped += 1
            return False
        self.spacing.learn(reply)
        self.stats.interval_steps = self.spacing.interval()
        if reply.get("ok"):
            job.slot, job.path, job.state = int(reply["slot"]), str(reply["path"]), "copying"
            persist = reply.get("persist")
            job.persist = persist if isinstance(persist, str) else ""
            return True
        if reply.get("refused") == "unsupported":
            self._disable(str(reply.get("error")))
            job.state = "canceled"
            return False
        if reply.get("refused") != "busy":
            job.state, job.error = "failed", str(reply.get("error", "refused"))[:500]
        return False

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ftd-checkpoint", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        keep_stack_signal_off_this_thread()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._job is not None and not self._job.done.is_set())
                job = self._job
            assert job is not None
            try:
                if job.state == "waiting" and not self._wait_for_slot(job):
                    continue  # skipped (settle set done) or failed (below)
                if job.path == self._persister.reading:  # written to disk: no snapshot there
                    job.state = "canceled"  # (the slot stays incomplete, overwritable)
                    job.tensors.clear()
                    self.stats.skipped += 1
                    continue
                self._copy(job)
                self.stats.saved += 1
                if job.persist and not self._persister.offer(
                    Work(job.path, job.step, self.world, self.rank, job.persist)
                ):
                    self.stats.persist_skipped += 1
            except Exception as error:
                self.stats.failed += 1
                self.last_error = f"step {job.step}: {type(error).__name__}: {error}"[:500]
                print(
                    f"ftd_client.checkpoint: snapshot not saved: {self.last_error}", file=sys.stderr
                )
            finally:
                job.done.set()

    def _wait_for_slot(self, job: _Job) -> bool:
        """Ask again, backing off, until granted (True: copy it) or settled by the training."""
        delay = RETRY_FIRST_S
        while True:
            time.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)
            with job.asking:
                if job.state == "waiting":
                    self._begin(job)
                if job.state == "failed":
                    raise CheckpointError(job.error)
                if job.state != "waiting":
                    return job.state == "copying"

    def _copy(self, job: _Job) -> None:
        started, cpu = time.perf_counter(), time.thread_time()
        buffer = self._map(job.path, job.size)
        buffer[: len(_NO_HEADER)] = _NO_HEADER  # while it is written, the file is no snapshot
        for tensor, stored in job.tensors:
            if stored.nbytes:
                tensor_in(buffer, job.header.data_offset, stored).copy_(tensor)
        job.tensors.clear()
        buffer[HEADER_BYTES : HEADER_BYTES + len(job.skeleton)] = job.skeleton
        buffer[: HEADER.size] = job.header.pack()
        self.stats.copy_s = time.perf_counter() - started
        self.stats.copy_cpu_s = time.thread_time() - cpu
        self.spacing.spent(self.stats.copy_cpu_s + job.save_s)
        assert self.link is not None
        reply = self.link.request(CheckpointDone(job.step, job.slot))
        if not reply or not reply.get("ok"):
            raise CheckpointError(f"the daemon did not take the snapshot: {reply}")
        job.state = "done"

    def _map(self, path: str, size: int) -> mmap.mmap:
        mapped = self._maps.get(path)
        if mapped is not None and len(mapped[1]) == size:
            return mapped[1]
        if mapped is not None:
            with contextlib.suppress(BufferError):
                mapped[1].close()
            os.close(mapped[0])
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)  # a full tmpfs fails here, not as a SIGBUS later
            buffer = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            self._maps.pop(path, None)
            raise
        self._maps[path] = (fd, buffer)
        return buffer
