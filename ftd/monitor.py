"""Rank health: heartbeat and section deadlines, hang verdicts, timeout learning.

Each connected rank has one pending deadline: the nearest of its heartbeat, open-section and
out-of-section limits. A message only ever moves a deadline later, except a section start
whose limit falls before the armed timer, so timers are re-armed lazily: when one fires, the
deadline is recomputed from the rank's state and either re-armed or turned into a verdict.
The decisions are pure functions of (now, state, timeouts) so tests pass their own clock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ftd_client.protocol import ProtocolError

from ftd.ft_config import RankTimeouts

log = logging.getLogger("ftd.monitor")

HEARTBEATS = "heartbeats"
OUT_OF_SECTION = "out_of_section"


@dataclass(eq=False)  # identity: one object per rank, shared by the pids that speak for it
class RankHealth:
    local_rank: int
    global_rank: int
    pid: int
    connected_at: float | None = None
    """Monotonic time of the handshake; None while the rank has not contacted the daemon."""
    stack_signal: int | None = None
    last_heartbeat: float | None = None
    open_sections: dict[str, float] = field(default_factory=dict)
    out_of_section_since: float | None = None
    hung: bool = False
    simulated_hang: bool = False
    """The rank announced an injected hang (ft_config simulated_fault, POST /v1/faults)."""
    timer: asyncio.TimerHandle | None = None
    armed_at: float | None = None

    def snapshot(self, now: float) -> dict[str, Any]:
        section, since = (None, None)
        if self.open_sections:
            section, since = max(self.open_sections.items(), key=lambda item: item[1])
        return {
            "connected": self.connected_at is not None,
            "last_heartbeat_age_s": (
                round(now - self.last_heartbeat, 6) if self.last_heartbeat is not None else None
            ),
            "section": section,
            "section_age_s": round(now - since, 6) if since is not None else None,
        }


@dataclass(frozen=True)
class Deadline:
    at: float
    kind: str
    """`initial_heartbeat`, `heartbeat`, `section` or `out_of_section`."""
    timeout: float
    section: str | None = None

    def reason(self, rank: RankHealth, now: float) -> str:
        what = {
            "initial_heartbeat": "sent no first heartbeat within initial_rank_heartbeat_timeout",
            "heartbeat": "sent no heartbeat within rank_heartbeat_timeout",
            "section": f"stayed in section {self.section!r} past its timeout",
            "out_of_section": "stayed out of any section past rank_out_of_section_timeout",
        }[self.kind]
        return (
            f"rank {rank.global_rank} (local {rank.local_rank}, pid {rank.pid}) hung: {what} "
            f"({self.timeout:g}s; overdue by {1000 * (now - self.at):.1f} ms)"
        )


def next_deadline(rank: RankHealth, timeouts: RankTimeouts) -> Deadline | None:
    """The rank's nearest deadline under `timeouts`, or None when nothing is being timed."""
    if rank.connected_at is None or rank.hung:
        return None
    candidates: list[Deadline] = []
    if rank.last_heartbeat is None:
        if (limit := timeouts.initial_rank_heartbeat_timeout) is not None:
            candidates.append(Deadline(rank.connected_at + limit, "initial_heartbeat", limit))
    elif (limit := timeouts.rank_heartbeat_timeout) is not None:
        candidates.append(Deadline(rank.last_heartbeat + limit, "heartbeat", limit))
    for name, started in rank.open_sections.items():
        if (limit := timeouts.rank_section_timeouts.get(name)) is not None:
            candidates.append(Deadline(started + limit, "section", limit, name))
    limit = timeouts.rank_out_of_section_timeout
    if rank.out_of_section_since is not None and not rank.open_sections and limit is not None:
        candidates.append(Deadline(rank.out_of_section_since + limit, "out_of_section", limit))
    return min(candidates, key=lambda deadline: deadline.at, default=None)


@dataclass
class Observations:
    """The longest intervals seen on this node, the material timeouts are learned from."""

    first_heartbeat: float | None = None
    heartbeat_interval: float | None = None
    sections: dict[str, float] = field(default_factory=dict)
    out_of_section: float | None = None

    def see(self, name: str, seconds: float) -> None:
        if name == "first_heartbeat":
            self.first_heartbeat = max(self.first_heartbeat or 0.0, seconds)
        elif name == HEARTBEATS:
            self.heartbeat_interval = max(self.heartbeat_interval or 0.0, seconds)
        elif name == OUT_OF_SECTION:
            self.out_of_section = max(self.out_of_section or 0.0, seconds)
        else:
            self.sections[name] = max(self.sections.get(name, 0.0), seconds)


def learn_timeouts(
    current: RankTimeouts,
    learned: frozenset[str],
    seen: Observations,
    safety_factor: float,
    sections: list[str] | None = None,
    out_of_section: bool = True,
    floor: float = 0.0,
) -> tuple[RankTimeouts, frozenset[str]]:
    """ft_launcher's rule: timeout = longest observed interval * safety_factor (at least
    `floor`), blended 50/50 with the previous value when that one was itself learned. Returns
    the new timeouts and the names of those now learned (`sections` None: every observed
    section)."""
    values = current.model_dump()
    now_learned = set(learned)

    def blend(key: str, previous: float | None, observed: float) -> float:
        value = max(observed * safety_factor, floor)
        if key in learned and previous is not None:
            value = (previous + value) / 2
        now_learned.add(key)
        return round(value, 6)

    if seen.first_heartbeat is not None:
        values["initial_rank_heartbeat_timeout"] = blend(
            "initial_rank_heartbeat_timeout",
            current.initial_rank_heartbeat_timeout,
            seen.first_heartbeat,
        )
    if seen.heartbeat_interval is not None:
        values["rank_heartbeat_timeout"] = blend(
            "rank_heartbeat_timeout", current.rank_heartbeat_timeout, seen.heartbeat_interval
        )
    section_values = dict(current.rank_section_timeouts)
    for name, observed in seen.sections.items():
        if sections is None or name in sections:
            section_values[name] = blend(f"section:{name}", section_values.get(name), observed)
    values["rank_section_timeouts"] = section_values
    if out_of_section and seen.out_of_section is not None:
        values["rank_out_of_section_timeout"] = blend(
            "rank_out_of_section_timeout",
            current.rank_out_of_section_timeout,
            seen.out_of_section,
        )
    return RankTimeouts.model_validate(values), frozenset(now_learned)


HangHandler = Callable[[RankHealth, str], None]


class Monitor:
    """Owns every rank's health for the current attempt; the daemon routes messages here."""

    def __init__(self, timeouts: RankTimeouts, on_hang: HangHandler) -> None:
        self.timeouts = timeouts
        self.observed = Observations()
        self._on_hang = on_hang
        self._by_pid: dict[int, RankHealth] = {}
        self._loop = asyncio.get_running_loop()

    # -- the attempt's ranks -----------------------------------------------------------------

    def attach(self, ranks: list[tuple[int, int, int]]) -> None:
        """A new attempt's ranks as (local_rank, global_rank, pid); forgets the previous ones."""
        self.detach()
        self._by_pid = {pid: RankHealth(lr, gr, pid) for lr, gr, pid in ranks}

    def detach(self) -> None:
        for rank in self._by_pid.values():
            self._disarm(rank)
        self._by_pid = {}

    def replace(
        self, old_pid: int | None, local_rank: int, global_rank: int, pid: int
    ) -> RankHealth:
        """A rank's process was respawned (in-process mode): the new pid starts afresh."""
        old = self._by_pid.pop(old_pid, None) if old_pid is not None else None
        if old is not None:
            self._disarm(old)
        rank = self._by_pid[pid] = RankHealth(local_rank, global_rank, pid)
        return rank

    def rank_of(self, pid: int) -> RankHealth | None:
        return self._by_pid.get(pid)

    def ranks(self) -> list[RankHealth]:
        return list(self._by_pid.values())

    def adopt(self, pid: int, rank: RankHealth) -> None:
        """Messages from `pid` (a descendant of the rank) count as the rank's own."""
        self._by_pid[pid] = rank

    def set_timeouts(self, timeouts: RankTimeouts) -> None:
        self.timeouts = timeouts
        now = time.monotonic()
        for rank in set(self._by_pid.values()):
            self._disarm(rank)
            self._arm(rank, now)

    # -- messages ----------------------------------------------------------------------------

    def on_hello(self, rank: RankHealth, stack_signal: object, now: float) -> None:
        if rank.connected_at is None:
            rank.connected_at = now
            rank.out_of_section_since = now
        rank.stack_signal = stack_signal if isinstance(stack_signal, int) else None
        self._arm(rank, now)

    def on_heartbeat(self, rank: RankHealth, now: float) -> None:
        self._ensure_connected(rank, now)
        if rank.last_heartbeat is None:
            assert rank.connected_at is not None
            self.observed.see("first_heartbeat", now - rank.connected_at)
        else:
            self.observed.see(HEARTBEATS, now - rank.last_heartbeat)
        rank.last_heartbeat = now
        if rank.timer is None:
            self._arm(rank, now)

    def on_section_start(self, rank: RankHealth, name: str, now: float) -> None:
        self._ensure_connected(rank, now)
        if not rank.open_sections and rank.out_of_section_since is not None:
            self.observed.see(OUT_OF_SECTION, now - rank.out_of_section_since)
        rank.open_sections[name] = now
        rank.out_of_section_since = None
        limit = self.timeouts.rank_section_timeouts.get(name)
        if limit is not None and (rank.armed_at is None or now + limit < rank.armed_at):
            self._disarm(rank)
            self._arm(rank, now)

    def on_section_end(self, rank: RankHealth, name: str, now: float) -> None:
        started = rank.open_sections.pop(name, None)
        if started is None:
            raise ProtocolError("section_not_open", f"end of section {name!r} that is not open")
        self.observed.see(name, now - started)
        if not rank.open_sections:
            rank.out_of_section_since = now
            if self.timeouts.rank_out_of_section_timeout is not None:
                self._disarm(rank)
                self._arm(rank, now)

    def on_goodbye(self, rank: RankHealth) -> None:
        """The rank stopped monitoring itself (shutdown): nothing more is timed for it."""
        self._disarm(rank)
        rank.connected_at = None

    # -- deadlines ---------------------------------------------------------------------------

    def _ensure_connected(self, rank: RankHealth, now: float) -> None:
        if rank.connected_at is None:  # a message before (or without) the handshake
            self.on_hello(rank, rank.stack_signal, now)

    def _arm(self, rank: RankHealth, now: float) -> None:
        deadline = next_deadline(rank, self.timeouts)
        if deadline is None:
            return
        rank.armed_at = deadline.at
        rank.timer = self._loop.call_later(max(0.0, deadline.at - now), self._on_timer, rank)

    def _disarm(self, rank: RankHealth) -> None:
        if rank.timer is not None:
            rank.timer.cancel()
        rank.timer = rank.armed_at = None

    def _on_timer(self, rank: RankHealth) -> None:
        rank.timer = rank.armed_at = None
        now = time.monotonic()
        deadline = next_deadline(rank, self.timeouts)
        if deadline is None:
            return
        if deadline.at > now:
            self._arm(rank, now)
            return
        rank.hung = True
        self._on_hang(rank, deadline.reason(rank, now))
