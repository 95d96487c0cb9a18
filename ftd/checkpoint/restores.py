"""What the ranks' restores cost the job: the steps each one lost, the redo it waits for, and
when the job was back where it had been (the recovery's `restore` and `redo` stages).

A rank can say anything about its steps, so what it says moves these figures only within
bounds: a restore counts once per fault that began a restart (a rank repeating its restore
request or its `cks` in one attempt counts nothing again), a step far past the rank's last
(MAX_STEP_JUMP) is not believed, and no restore loses more than MAX_STEP_JUMP steps.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ftd.checkpoint.spacing import SnapshotSpacing

MAX_STEP_JUMP = 2**20
"""The most steps a rank's report may move past its last one and be believed, and the most one
restore can lose (the longest snapshot interval, protocol.CHECKPOINT_OPTIONAL's `every`)."""


class RestoreAccount:
    def __init__(self, spacing: SnapshotSpacing) -> None:
        self._spacing = spacing
        """Counts the job's faults: one restore counted per fault."""
        self.steps_lost = 0
        """Steps the ranks finished but no restore kept, over every restore."""
        self.latest: dict[int, int] = {}
        """Each rank's newest step, with a snapshot or not (--checkpoint-every): the steps lost."""
        self.last_restore: dict[str, Any] | None = None
        self._restoring = False
        """Ranks are restoring and none saved since: the first restore request said the loss."""
        self._failures_restored = 0
        """The job's faults (spacing.failures) when a restore last counted the steps lost."""
        self.restore_asked_at: float | None = None
        """When a rank last asked which snapshot to restore (the end of a restart's `init`)."""
        self._redo_until: int | None = None
        """The step the job had reached when its last restore lost steps: redone once a rank
        begins to save it again."""
        self.restored_at: float | None = None
        """When the ranks' last restore (of a step) began."""
        self.caught_up_at: float | None = None
        self.caught_up = asyncio.Event()
        self.stepped_at: float | None = None
        """When (time.monotonic) a rank last said it did a step: a snapshot or a `cks`."""
        """Set once the job is back at the step it had reached before its last restore."""

    def counts(self) -> bool:
        """Whether a restore now is the first since a fault began a restart (or the job's
        first)."""
        return not self._restoring and (
            self.last_restore is None or self._spacing.failures > self._failures_restored
        )

    def restored(self, step: int, world: int | None, newest: int | None, source: str) -> int:
        """The ranks restored `step` after a failure (`newest`: the newest step a snapshot was
        begun of): the steps lost, and the redo to wait for."""
        self._restoring = True
        self._failures_restored = self._spacing.failures
        done = (s for r, s in self.latest.items() if world is None or r < world)
        lost = min(max(max(done, default=0), newest or 0, step) - step, MAX_STEP_JUMP)
        self.steps_lost += lost
        self.restored_at = time.time()
        self._redo_until = step + lost if lost else None
        self.caught_up_at = None if lost else self.restored_at
        if lost:
            self.caught_up.clear()
        else:
            self.caught_up.set()
        self.last_restore = {
            "step": step,
            "steps_lost": lost,
            "time": round(time.time(), 3),
            "source": source,
        }
        return lost

    def reached(self, rank: int, step: int) -> None:
        """`rank` did `step` (and took a snapshot of it or not): the job is past its restore."""
        previous = self.latest.get(rank)
        if previous is None or step <= previous + MAX_STEP_JUMP:
            self.latest[rank] = step
        self.stepped_at = time.monotonic()
        self._restoring = False
        if self._redo_until is not None and step >= self._redo_until:
            self._redo_until = None
            self.caught_up_at = time.time()
            self.caught_up.set()
