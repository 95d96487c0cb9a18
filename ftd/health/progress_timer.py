"""The progress watch's verdicts on the event loop: a look every PROGRESS_TICK_S.

A tick costs a pass over the node's ranks; ranks report at most twice a second, so a verdict
comes at most a tick plus a report interval after the deadline. Before a verdict the rank
socket is drained (a report queued behind the tick counts); a tick much later than planned
means the daemon itself did not run, and no rank is blamed for that time.
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
            planned = now + PROGRESS_TICK_S
            if not self.watch.armed:  # nothing to judge before an attempt's first step
                continue
            try:
                containment.inject("monitor")
                self._tick(now)
            except Exception as error:  # the attempt ends with it, supervision goes on
                self._on_error(containment.record("monitor", error))

    def _tick(self, now: float) -> None:
        if self.watch.check(now, self._section_timed) is None:
            return
        self._drain()
        verdict = self.watch.check(time.monotonic(), self._section_timed)
        if verdict is not None:
            self.watch.judged()
            self._on_verdict(verdict)
