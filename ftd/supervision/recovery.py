"""A restart, stage by stage: how long detection, stopping, the crash-loop back-off, rendezvous,
spawning, the new ranks' start-up, their restore and the redone steps took. Marks are wall-clock
seconds; the stages add up to fault -> back where the job was (`total_s`).

`init` runs from the spawn to the ranks' request for their snapshot (ftd_client.checkpoint.load),
`restore` from there to every rank's first step; where no rank restores a snapshot, `init` runs
to the first step and `restore` is null. `redo` runs from the first step to the moment a rank
saves the step the job had reached before the fault again (0 when the restore lost no step;
null where no snapshot was restored)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ftd.status.recovery_stages import STAGES


@dataclass
class Recovery:
    cause: str
    origin: float
    """When the fault began, as far as this daemon can tell: a rank's exit, a hung rank's last
    sign of life, a request's arrival."""
    decided: float
    """When the daemon knew the attempt had to end (exit seen, hang judged, request read)."""
    stopped: float | None = None
    backed_off: float | None = None
    """The crash-loop back-off (--restart-backoff) was over (at once when there was none):
    its wait is not the rendezvous's."""
    rendezvous: float | None = None
    """The next round closed: the placement is known."""
    spawned: float | None = None
    restore_asked: float | None = None
    """The new ranks last asked which snapshot to restore (None: none asked)."""
    resumed: float | None = None
    """Every rank of the next attempt took its first step: an optimizer step where an earlier
    attempt made some, else its first heartbeat, section or resumed()."""
    caught_up: float | None = None
    """A rank saved the step the job had reached before the fault (None: no restore, or not
    yet)."""

    def stages(self) -> dict[str, float | None]:
        backed_off = self.backed_off
        if backed_off is None and self.stopped is not None and self.rendezvous is not None:
            backed_off = self.stopped  # no back-off marked (a round ended elsewhere): none
        asked = self.restore_asked
        if asked is None or self.spawned is None or not self.spawned <= asked:
            asked = None  # no restore by this attempt's ranks
        elif self.resumed is not None and asked > self.resumed:
            asked = None  # a first step before the restore: the start-up is all `init`
        caught_up = self.caught_up
        if caught_up is not None and self.resumed is not None:  # nothing lost: caught up at once
            caught_up = max(caught_up, self.resumed)
        intervals = [
            (self.origin, self.decided),
            (self.decided, self.stopped),
            (self.stopped, backed_off),
            (backed_off, self.rendezvous),
            (self.rendezvous, self.spawned),
            (self.spawned, self.resumed if asked is None else asked),
            (asked, None if asked is None else self.resumed),
            (None if asked is None else self.resumed, caught_up),
        ]
        return {
            name: round(end - start, 6) if start is not None and end is not None else None
            for name, (start, end) in zip(STAGES, intervals, strict=True)
        }

    def event_data(self, attempt: int) -> dict[str, Any]:
        stages = self.stages()
        redo = stages["redo"]
        end = self.resumed + redo if redo is not None and self.resumed is not None else self.resumed
        return {
            "attempt": attempt,
            "round": attempt,
            "cause": self.cause,
            "stages": stages,
            "total_s": round(end - self.origin, 6) if end is not None else None,
            "failure_time": self.origin,
        }
