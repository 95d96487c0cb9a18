"""The progress watch's verdicts on the event loop: a look when the next verdict could be due.

The watch says when that is (ProgressWatch.next_due: the stalest rank's deadline); the timer
sleeps until then, at most IDLE_LOOK_S (a report may move it later; a learned deadline only
grows), and at least PROGRESS_TICK_S after a look that found a rank due but not judged (one
inside a timed section of its script's). So a job whose ranks move costs a wake-up every few
seconds, not four a second, and a verdict comes within a report interval of its deadline.
Before a verdict the rank socket is drained (a report queued behind the look counts); a look
much later than planned means the daemon itself did not run, and no rank is blamed for that
time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ftd import containment
from ftd.health.links import RankHealth
from ftd.health.monitor import STALL_THRESHOLD_S
from ftd.health.progress import ProgressVerdict, ProgressWatch
from ftd.tasks import Background

PROGRESS_TICK_S = 0.25
IDLE_LOOK_S = 5.0
UNARMED_LOOK_S = 1.0
"""Before the attempt's first step: how soon a deadline as short as the floor is first looked at."""
"""The longest the timer sleeps (before an attempt's first step, or while every deadline is far)."""


class ProgressTimer:
    def __init__(
        self,
        watch: ProgressWatch,
        drain: Callable[[], object],
        on_verdict: Callable[[ProgressVerdict], None],
        on_error: Callable[[str], None],
        section_timed: Callable[[RankHealth], bool],
    ) -> None:
        self.watch = watch
        self._section_timed = section_timed
        """Whether a rank is inside a section with a timeout in force (the monitor's)."""
        self._drain = drain
        self._on_verdict = on_verdict
        self._on_error = on_error
        self._background = Background()

    def start(self) -> None:
        self._background.spawn(self._run(), "progress-verdicts")

    def close(self) -> None:
        self._background.cancel()

    async def _run(self) -> None:
        planned = time.monotonic() + PROGRESS_TICK_S
        while True:
            await asyncio.sleep(max(planned - time.monotonic(), 0.0))
            now = time.monotonic()
            if now - planned > STALL_THRESHOLD_S:
                self.watch.paused(now - planned)
            planned = now + self._pause(now)
            if not self.watch.armed:  # nothing to judge before an attempt's first step
                continue
            try:
                containment.inject("monitor")
                self._tick(now)
            except Exception as error:  # the attempt ends with it, supervision goes on
                self._on_error(containment.record("monitor", error))
            planned = now + self._pause(now)

    def _pause(self, now: float) -> float:
        """Until the next look: the next possible verdict, within [tick, IDLE_LOOK_S] once it
        is past (a rank due, not judged), else up to IDLE_LOOK_S."""
        due = self.watch.next_due()
        if due is None:  # judged or off: nothing due; not armed: the first step arms it
            return IDLE_LOOK_S if self.watch.armed else UNARMED_LOOK_S
        if due <= now:
            return PROGRESS_TICK_S
        return min(due - now, IDLE_LOOK_S)

    def _tick(self, now: float) -> None:
        if self.watch.check(now, self._section_timed) is None:
            return
        self._drain()
        verdict = self.watch.check(time.monotonic(), self._section_timed)
        if verdict is not None:
            self.watch.judged()
            self._on_verdict(verdict)
