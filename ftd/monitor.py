"""Rank health: heartbeat and section deadlines, hang verdicts, timeout learning.

Each connected rank has one pending timer, never later than its earliest deadline (the nearest
of its heartbeat, open-section and out-of-section limits). Most messages move the deadline later
and leave the timer alone; when it fires early the deadline is recomputed and the timer re-armed.
Any change that can bring the deadline earlier (the first heartbeat, when the subsequent timeout
is shorter than the initial one; a section start; a section end; new timeouts) re-arms at once.

Before a verdict the rank socket is drained (a heartbeat queued behind the timer counts), and a
timer that fires much later than its deadline means the daemon itself was not running (SIGSTOP,
a swap storm, a frozen VM): every rank then gets a fresh grace period instead of a verdict.
When several ranks are overdue together, the one whose last sign of life is oldest stopped first
and is named first. The decisions are pure functions of (now, state, timeouts); tests pass a
fake clock.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ftd_client.protocol import ProtocolError

from ftd.ft_config import RankTimeouts

log = logging.getLogger("ftd.monitor")

HEARTBEATS = "heartbeats"
OUT_OF_SECTION = "out_of_section"
STALL_THRESHOLD_S = 1.0
"""A timer this much later than its deadline means the daemon was not running, not the rank."""
BLAME_WINDOW_MAX_S = 1.0
BLAME_WINDOW_FRACTION = 0.25
"""Ranks whose deadlines fall within one heartbeat interval of a verdict (at most a second, at
most a quarter of the timeout that fell due) are judged together: the one silent longest is
named first."""
UNREGISTRABLE_SIGNALS = frozenset({signal.SIGKILL, signal.SIGSTOP})


class Cancellable(Protocol):
    def cancel(self) -> None: ...


@dataclass(eq=False)  # identity: one object per rank, shared by the pids that speak for it
class RankHealth:
    local_rank: int
    global_rank: int
    pid: int
    connected_at: float | None = None
    """Monotonic time of the handshake; None while the rank has not contacted the daemon."""
    stack_signal: int | None = None
    last_heartbeat: float | None = None
    last_seen: float | None = None
    """The rank's last sign of life: its newest message of any kind."""
    open_sections: dict[str, float] = field(default_factory=dict)
    out_of_section_since: float | None = None
    hung: bool = False
    simulated_hang: bool = False
    """The rank announced an injected hang (ft_config simulated_fault, POST /v1/faults)."""
    timer: Cancellable | None = None
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
        """One sentence for logs, events and the failure summary."""
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


def valid_stack_signal(value: object) -> int | None:
    """A signal number a rank may ask to be sent for its stack dump, else None: a real,
    catchable signal (never SIGKILL or SIGSTOP, never a huge or negative integer)."""
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    try:
        sig = signal.Signals(value)
    except ValueError:
        return None
    if sig in UNREGISTRABLE_SIGNALS or sig not in signal.valid_signals():
        return None
    return int(sig)


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


class Clock(Protocol):
    """Monotonic time and timers: the event loop in the daemon, a fake clock in tests."""

    def now(self) -> float: ...

    def call_later(
        self, delay: float, callback: Callable[[RankHealth], None], rank: RankHealth
    ) -> Cancellable: ...


class LoopClock:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def now(self) -> float:
        return time.monotonic()

    def call_later(
        self, delay: float, callback: Callable[[RankHealth], None], rank: RankHealth
    ) -> Cancellable:
        return self._loop.call_later(delay, callback, rank)


@dataclass(frozen=True)
class Overdue:
    rank: RankHealth
    deadline: Deadline

    def reason(self, now: float) -> str:
        return self.deadline.reason(self.rank, now)


@dataclass(frozen=True)
class Verdict:
    """Ranks found hung together, the one silent longest first."""

    overdue: tuple[Overdue, ...]
    at: float

    @property
    def first(self) -> Overdue:
        return self.overdue[0]


def order_by_silence(overdue: list[Overdue]) -> list[Overdue]:
    """The rank whose last sign of life is oldest stopped first: it comes first (a rank waiting
    on it in a collective stopped talking later); ties by global rank."""

    def silent_since(item: Overdue) -> float:
        rank = item.rank
        seen = rank.last_seen if rank.last_seen is not None else rank.connected_at
        return seen if seen is not None else float("-inf")

    return sorted(overdue, key=lambda item: (silent_since(item), item.rank.global_rank))


HangHandler = Callable[[Verdict], None]


class Monitor:
    """Owns every rank's health for the current attempt; the daemon routes messages here."""

    def __init__(
        self,
        timeouts: RankTimeouts,
        on_hang: HangHandler,
        clock: Clock | None = None,
        drain: Callable[[], None] | None = None,
    ) -> None:
        self.timeouts = timeouts
        self.observed = Observations()
        self.stalls = 0
        """Times the daemon was found not to have run for a while (no verdict was made then)."""
        self._on_hang = on_hang
        self._clock = clock or LoopClock(asyncio.get_running_loop())
        self.drain = drain
        """Reads every queued rank message (the socket's), called before a verdict."""
        self._by_pid: dict[int, RankHealth] = {}
        self._recent_interval = 0.0

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
        return list({id(rank): rank for rank in self._by_pid.values()}.values())

    def adopt(self, pid: int, rank: RankHealth) -> None:
        """Messages from `pid` (a descendant of the rank) count as the rank's own."""
        self._by_pid[pid] = rank

    def set_timeouts(self, timeouts: RankTimeouts) -> None:
        self.timeouts = timeouts
        now = self._clock.now()
        for rank in self.ranks():
            self._disarm(rank)
            self._arm(rank, now)

    # -- messages ----------------------------------------------------------------------------

    def on_hello(self, rank: RankHealth, stack_signal: object, now: float) -> None:
        if rank.connected_at is None:
            rank.connected_at = now
            rank.out_of_section_since = now
        rank.last_seen = now
        rank.stack_signal = valid_stack_signal(stack_signal)
        self._rearm_if_earlier(rank, now)

    def on_heartbeat(self, rank: RankHealth, now: float) -> None:
        self._ensure_connected(rank, now)
        if rank.last_heartbeat is None:
            assert rank.connected_at is not None
            self.observed.see("first_heartbeat", now - rank.connected_at)
        else:
            interval = now - rank.last_heartbeat
            self.observed.see(HEARTBEATS, interval)
            self._recent_interval = interval
        rank.last_heartbeat = rank.last_seen = now
        # Only the heartbeat limit moved (later, or from the initial to the subsequent one).
        limit = self.timeouts.rank_heartbeat_timeout
        if rank.armed_at is None or (limit is not None and now + limit < rank.armed_at):
            self._rearm_if_earlier(rank, now)

    def on_section_start(self, rank: RankHealth, name: str, now: float) -> None:
        self._ensure_connected(rank, now)
        if not rank.open_sections and rank.out_of_section_since is not None:
            self.observed.see(OUT_OF_SECTION, now - rank.out_of_section_since)
        rank.open_sections[name] = rank.last_seen = now
        rank.out_of_section_since = None
        self._rearm_if_earlier(rank, now)

    def on_section_end(self, rank: RankHealth, name: str, now: float) -> None:
        self._ensure_connected(rank, now)
        started = rank.open_sections.pop(name, None)
        if started is None:
            raise ProtocolError("section_not_open", f"end of section {name!r} that is not open")
        rank.last_seen = now
        self.observed.see(name, now - started)
        if not rank.open_sections:
            rank.out_of_section_since = now
        self._rearm_if_earlier(rank, now)

    def on_goodbye(self, rank: RankHealth) -> None:
        """The rank stopped monitoring itself (shutdown): nothing more is timed for it."""
        self._disarm(rank)
        rank.connected_at = None

    # -- deadlines ---------------------------------------------------------------------------

    def _ensure_connected(self, rank: RankHealth, now: float) -> None:
        if rank.connected_at is None:  # a message before (or without) the handshake
            self.on_hello(rank, rank.stack_signal, now)

    def _rearm_if_earlier(self, rank: RankHealth, now: float) -> None:
        """Keep the timer at or before the rank's earliest deadline (never later)."""
        deadline = next_deadline(rank, self.timeouts)
        if deadline is not None and (rank.armed_at is None or deadline.at < rank.armed_at):
            self._disarm(rank)
            self._arm_at(rank, deadline.at, now)

    def _arm(self, rank: RankHealth, now: float) -> None:
        deadline = next_deadline(rank, self.timeouts)
        if deadline is not None:
            self._arm_at(rank, deadline.at, now)

    def _arm_at(self, rank: RankHealth, at: float, now: float) -> None:
        rank.armed_at = max(at, now)  # when the timer is due to fire (a stall makes it late)
        rank.timer = self._clock.call_later(rank.armed_at - now, self._on_timer, rank)

    def _disarm(self, rank: RankHealth) -> None:
        if rank.timer is not None:
            rank.timer.cancel()
        rank.timer = rank.armed_at = None

    def _on_timer(self, rank: RankHealth) -> None:
        armed_at = rank.armed_at
        rank.timer = rank.armed_at = None
        now = self._clock.now()
        deadline = next_deadline(rank, self.timeouts)
        if deadline is not None and deadline.at <= now and self.drain is not None:
            self.drain()  # a heartbeat queued behind this timer is a sign of life
            if rank.timer is not None:  # the drain re-armed it
                return
            deadline = next_deadline(rank, self.timeouts)
        if deadline is None:
            return
        if deadline.at > now:
            self._arm_at(rank, deadline.at, now)
            return
        if armed_at is not None and now - armed_at > STALL_THRESHOLD_S:
            self._grace_after_stall(now, now - armed_at)
            return
        self._judge(now, deadline)

    def _grace_after_stall(self, now: float, late_s: float) -> None:
        """The daemon did not run for `late_s`: nobody can say who was silent then. Every rank
        is timed afresh from now."""
        self.stalls += 1
        log.warning(
            "the daemon did not run for %.1f s (stopped, swapped out or starved): every rank "
            "gets a fresh grace period instead of a hang verdict",
            late_s,
        )
        for rank in self.ranks():
            if rank.connected_at is None or rank.hung:
                continue
            rank.connected_at = now if rank.last_heartbeat is None else rank.connected_at
            if rank.last_heartbeat is not None:
                rank.last_heartbeat = now
            rank.open_sections = dict.fromkeys(rank.open_sections, now)
            if rank.out_of_section_since is not None:
                rank.out_of_section_since = now
            self._disarm(rank)
            self._arm(rank, now)

    def _judge(self, now: float, due: Deadline) -> None:
        """Every rank overdue now or within one heartbeat interval is judged together."""
        window = min(self._recent_interval, BLAME_WINDOW_MAX_S, BLAME_WINDOW_FRACTION * due.timeout)
        overdue: list[Overdue] = []
        for rank in self.ranks():
            deadline = next_deadline(rank, self.timeouts)
            if deadline is not None and deadline.at <= now + window:
                overdue.append(Overdue(rank, deadline))
        if not overdue:
            return
        for item in overdue:
            item.rank.hung = True
            self._disarm(item.rank)
        self._on_hang(Verdict(tuple(order_by_silence(overdue)), now))
