"""The timeouts in force and which of them were learned: one writer for both.

Every change comes here, whoever makes it (the operator through the API, a rank's `set` or
`calc`, NVRx's client, learning at an attempt's end): it is validated by RankTimeouts, handed
to the monitor that times the ranks, written to the state file (so learned timeouts survive
restarts of the ranks and of the daemon) and said once as a `timeouts_changed` event.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from ftd_client.messages import CalculateTimeouts
from pydantic import ValidationError

from ftd.config.ft import FaultToleranceConfig, RankTimeouts
from ftd.errors import InvalidRequest, format_validation_error
from ftd.health.calculate import requested_values
from ftd.health.learning import Base, Generations, NotReady, apply_values, learn_timeouts
from ftd.health.links import RankHealth
from ftd.health.monitor import Monitor
from ftd.health.socket import Reply
from ftd.health.sync import patched_sections
from ftd.status.event_kind import EventKind
from ftd.status.events import EventLog
from ftd.status.persist import Persistence

log = logging.getLogger("ftd.health")


class TimeoutsKeeper:
    def __init__(
        self,
        ft: FaultToleranceConfig,
        monitor: Monitor,
        learned: frozenset[str],
        events: EventLog,
        persist: Persistence,
        state_file: Path,
    ) -> None:
        """`monitor` holds the timeouts in force (loaded with `learned` from the state file)."""
        self._ft = ft
        self._monitor = monitor
        self._learned = learned
        self._events = events
        self._persist = persist
        self._state_file = state_file
        self._generations = Generations()

    @property
    def timeouts(self) -> RankTimeouts:
        return self._monitor.timeouts

    def learn(
        self, by: str, sections: list[str] | None = None, out_of_section: bool = True
    ) -> RankTimeouts:
        """ft_launcher's rule over what the monitor observed (learning.learn_timeouts)."""
        timeouts, self._learned = learn_timeouts(
            self.timeouts,
            self._learned,
            self._monitor.observed,
            self._ft.safety_factor,
            sections,
            out_of_section,
            floor=self._ft.min_learned_timeout,
        )
        self._apply(timeouts, by, learned=True)
        return timeouts

    def update(
        self,
        patch: Mapping[str, object],
        by: str,
        learned: frozenset[str] = frozenset(),
        rank: RankHealth | None = None,
    ) -> RankTimeouts:
        """Apply a partial update, validated by the same model as the CLI; `learned` names the
        values that were calculated (a checkpoint's learned timeouts), the rest are set."""
        merged = {**self.timeouts.model_dump(), **patch}
        try:
            timeouts = RankTimeouts.model_validate(merged)
        except ValidationError as error:
            raise InvalidRequest(format_validation_error(error)) from None
        # Values set by hand are no longer learned ones.
        keys = set(patch) | {f"section:{s}" for s in patched_sections(patch)}
        self._learned = (self._learned - keys) | (learned & keys)
        if "initial_rank_heartbeat_timeout" in set(patch) - learned:
            # Set by hand, it bounds a rank's time to connect too (a learned one does not).
            self._monitor.set_timeouts(self.timeouts, timeouts.initial_rank_heartbeat_timeout)
        self._apply(timeouts, by, bool(learned & keys), rank)
        return timeouts

    def set_calculated(
        self, timeouts: RankTimeouts, by: str, learned: set[str], unlearned: set[str]
    ) -> None:
        """Timeouts a rank calculated itself: `learned` names now count as learned ones,
        `unlearned` as set."""
        self._learned = (self._learned - unlearned) | learned
        self._apply(timeouts, by, learned=bool(learned))

    def calculate(self, rank: RankHealth, message: CalculateTimeouts, now: float) -> Reply:
        """A rank's `calc`: NVRx's rule, one result per generation of calls (learning.py)."""
        current = Base(self.timeouts, self._learned)
        try:
            values = requested_values(
                message, rank, now, current, self._generations, self._monitor, self._ft
            )
        except NotReady as error:
            return {"ok": False, "error": f"not ready: {error}"}
        self._learned = self._learned | set(values)
        timeouts = apply_values(self.timeouts, values)
        self._apply(timeouts, f"rank {rank.global_rank}", True, rank)
        return self.reply(timeouts)

    def reply(self, timeouts: RankTimeouts) -> Reply:
        """What a rank is answered: the timeouts, and which were learned."""
        return {"ok": True, "timeouts": timeouts.model_dump(), "learned": sorted(self._learned)}

    def new_attempt(self) -> None:
        self._generations.reset()

    def _apply(
        self, timeouts: RankTimeouts, by: str, learned: bool, rank: RankHealth | None = None
    ) -> None:
        """`rank`: the rank whose message changed them (its events are budgeted)."""
        if timeouts == self.timeouts:
            return
        previous, now = self.timeouts.model_dump(), timeouts.model_dump()
        self._monitor.set_timeouts(timeouts)
        state = {"timeouts": now, "learned": sorted(self._learned)}
        self._persist.write_json(self._state_file, state)
        data = {"timeouts": now, "by": by, "learned": learned, "previous": previous}
        if rank is None:
            self._events.emit(EventKind.TIMEOUTS_CHANGED, **data)
        else:
            self._events.emit_for_rank(rank.global_rank, EventKind.TIMEOUTS_CHANGED, **data)
        log.info("timeouts changed by %s: %s", by, now)
