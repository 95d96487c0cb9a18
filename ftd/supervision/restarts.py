"""What a restart leaves behind: its recovery stages, and the crash-loop back-off.

`RecoveryTimeline` marks a restart's stages as the supervisor reaches them and reports them
(a `recovery` event, the stage histograms, the status) once every rank of the next attempt took
its first step. `CrashLoop` waits longer before each attempt after attempts that failed fast
one after another (kubelet's CrashLoopBackOff); an attempt that ran long enough resets it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from ftd.status.event_kind import EventKind
from ftd.status.instruments import RECOVERY_STAGE_SECONDS
from ftd.status.model import DaemonState, Failure
from ftd.supervision.policy import restart_backoff
from ftd.supervision.recovery import Recovery
from ftd.tasks import within

if TYPE_CHECKING:
    from ftd.status.board import StatusBoard
    from ftd.supervision.attempt import Attempt, AttemptTools
    from ftd.tasks import Background

log = logging.getLogger("ftd.daemon")


class RecoveryTimeline:
    """The restart in progress (none while an attempt runs undisturbed)."""

    def __init__(self, tools: AttemptTools, background: Background) -> None:
        self._tools = tools
        self._background = background
        self._recovery: Recovery | None = None
        self._latest: Recovery | None = None
        """The last restart begun, until it is reported."""
        self._next_fault = asyncio.Event()
        """Set when another restart begins: the one before stops waiting for its redo."""

    def begin(self, cause: str, failure: Failure | None) -> None:
        """The attempt has to end: the fault began at the failure's origin, if it has one."""
        now = time.time()
        decided = failure.timestamp if failure is not None and failure.timestamp else now
        origin = failure.origin if failure is not None and failure.origin else decided
        self._recovery = Recovery(cause=cause, origin=min(origin, decided), decided=decided)
        self._latest = self._recovery
        self._next_fault.set()
        # How often the job fails: the ranks' snapshot interval.
        self._tools.checkpoints.spacing.failed()

    def culprit_named(self, reason: str) -> None:
        """The job's culprit of the hang that began the last restart: its cause says it."""
        if self._latest is not None:
            self._latest.cause = f"{self._latest.cause}; {reason}"[:4000]

    def stopped(self) -> None:
        if self._recovery is not None:
            self._recovery.stopped = time.time()

    def backed_off(self) -> None:
        """The crash-loop back-off is over (or there was none): the rendezvous starts now."""
        if self._recovery is not None and self._recovery.stopped is not None:
            self._recovery.backed_off = time.time()

    def round_closed(self) -> None:
        if self._recovery is not None:
            self._recovery.rendezvous = time.time()

    def started(self, attempt: Attempt) -> None:
        recovery, self._recovery = self._recovery, None
        if recovery is None:
            return
        recovery.spawned = time.time()
        self._next_fault = next_fault = asyncio.Event()
        self._background.spawn(self._await_resumed(attempt, recovery, next_fault), "recovered")

    async def _await_resumed(
        self, attempt: Attempt, recovery: Recovery, next_fault: asyncio.Event
    ) -> None:
        """The restart is over once every rank of the new attempt took its first step and, where
        they restored a snapshot, the job is back at the step it had reached (or the next fault
        came, or the daemon stops: then without its `redo`)."""
        try:
            resumed = await self._tools.first_steps.wait(attempt.group)
            if resumed is not None:
                recovery.resumed = resumed
            if recovery.spawned is None:
                return
            restores = self._tools.checkpoints.restores
            recovery.restore_asked = restores.restore_asked_at
            if restores.restored_at is None or restores.restored_at < recovery.spawned:
                return
            caught_up = asyncio.ensure_future(restores.caught_up.wait())
            faulted = asyncio.ensure_future(next_fault.wait())
            try:
                await asyncio.wait((caught_up, faulted), return_when=asyncio.FIRST_COMPLETED)
            finally:
                caught_up.cancel()
                faulted.cancel()
            recovery.caught_up = restores.caught_up_at
        finally:
            self._report(attempt, recovery)

    def _report(self, attempt: Attempt, recovery: Recovery) -> None:
        if self._latest is recovery:
            self._latest = None
        data = recovery.event_data(attempt.number)
        for stage, seconds in data["stages"].items():
            if seconds is not None:
                RECOVERY_STAGE_SECONDS.labels(stage).observe(seconds)
        self._tools.board.recovered(data)
        self._tools.events.emit(EventKind.RECOVERY, **data)


class CrashLoop:
    """Fast failures in a row, and the wait they earn before the next attempt."""

    def __init__(self, tools: AttemptTools, board: StatusBoard, stop: asyncio.Event) -> None:
        self._tools = tools
        self._board = board
        self._stop = stop
        self.fast_failures = 0
        self.crashed = False
        """The last attempt ended by a failure of its own (not a request from elsewhere)."""

    async def back_off(self, number: int, ran_s: float) -> None:
        """Before the attempt after `number`, which ran `ran_s` seconds: wait if it crashed
        fast, after others that did (until a signal asks the daemon to stop). An attempt whose
        ranks made optimizer steps is no crash loop however short it was: waiting would only
        add to the time a failure costs (it made progress, and the next attempt resumes it)."""
        config = self._tools.config
        restores = self._tools.checkpoints.restores
        started = time.monotonic() - ran_s
        saved = (restores.stepped_at or float("-inf")) >= started
        progressed = self._tools.progress.node.attempt_made_steps or saved  # the sampler's report
        # may not have come before a rank that stepped for a moment died (SIGKILL: no last one)
        if ran_s >= config.restart_backoff_reset_s or not self.crashed or progressed:
            self.fast_failures = 0
            self._board.backing_off(0.0)
            return
        self.fast_failures += 1
        delay = restart_backoff(
            self.fast_failures, config.restart_backoff_base_s, config.restart_backoff_cap_s
        )
        self._board.backing_off(delay, self.fast_failures)
        if delay <= 0:
            return
        log.warning(
            "attempt %d failed %.1fs after it started, %d fast failures in a row: waiting %.1fs "
            "before the next (--restart-backoff)",
            number,
            ran_s,
            self.fast_failures,
            delay,
        )
        self._tools.events.emit(
            EventKind.RESTART_BACKOFF,
            attempt=number,
            delay_s=delay,
            fast_failures=self.fast_failures,
        )
        self._board.set_state(DaemonState.RESTARTING, f"backing off {delay:.1f}s (crash loop)")
        with contextlib.suppress(TimeoutError):
            await within(self._stop.wait(), delay)
