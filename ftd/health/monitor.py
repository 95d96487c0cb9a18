"""Rank health over time: one timer per rank on its nearest deadline, and hang verdicts.

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
from collections.abc import Callable, Sequence
from types import EllipsisType

from ftd_client.protocol import ProtocolError

from ftd import containment
from ftd.config.ft import RankTimeouts
from ftd.health.learning import HEARTBEATS, OUT_OF_SECTION, Observations
from ftd.health.links import (
    RESYNC_GRACE_S,
    Deadline,
    Link,
    RankHealth,
    next_deadline,
)
from ftd.health.sync import (
    NO_LINK,
    BudgetExceeded,
    SectionNames,
    apply_state,
    close_section,
    lose,
    open_section,
)
from ftd.health.verdict import Clock, LoopClock, Overdue, Verdict, order_by_silence

log = logging.getLogger("ftd.monitor")

STALL_THRESHOLD_S = 1.0
"""A timer this much later than its deadline means the daemon was not running, not the rank."""
BLAME_WINDOW_MAX_S = 1.0
BLAME_WINDOW_FRACTION = 0.25
"""Ranks whose deadlines fall within one heartbeat interval of a verdict (at most a second, at
most a quarter of the timeout that fell due) are judged together: the one silent longest is
named first."""


HangHandler = Callable[[Verdict], None]


class Monitor:
    """Owns every rank's health for the current attempt; the daemon routes messages here."""

    def __init__(
        self,
        timeouts: RankTimeouts,
        on_hang: HangHandler,
        clock: Clock | None = None,
        drain: Callable[[], object] | None = None,
        on_error: Callable[[str], None] | None = None,
        on_first_step: Callable[[RankHealth, float], None] | None = None,
        connect_timeout: float | EllipsisType | None = ...,
    ) -> None:
        self.timeouts = timeouts
        self.observed = Observations()
        self.stalls = 0
        """Times the daemon was found not to have run for a while (no verdict was made then)."""
        self._on_hang = on_hang
        self._clock = clock or LoopClock(asyncio.get_running_loop())
        self.drain = drain
        """Reads every queued rank message (the socket's), called before a verdict."""
        self.connect_timeout: float | None = (
            timeouts.initial_rank_heartbeat_timeout
            if isinstance(connect_timeout, EllipsisType)
            else connect_timeout
        )
        """A rank that has not contacted the daemon this long after its start is judged hung:
        the configured initial heartbeat timeout (never a learned one)."""
        self.on_first_step = on_first_step
        self.on_error = on_error
        """Told why, when a timer's work failed (a bug of ours): the attempt ends with it."""
        self.section_names = SectionNames(timeouts.rank_section_timeouts)
        self._by_pid: dict[int, RankHealth] = {}
        self._recent_interval = 0.0

    # -- the attempt's ranks -----------------------------------------------------------------

    def attach(self, ranks: list[tuple[int, int, int]]) -> None:
        """A new attempt's ranks as (local_rank, global_rank, pid); forgets the previous ones."""
        self.detach()
        now = self._clock.now()
        self._by_pid = {pid: RankHealth(lr, gr, pid, attached_at=now) for lr, gr, pid in ranks}
        for rank in self._by_pid.values():
            self._arm(rank, now)

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
        now = self._clock.now()
        rank = self._by_pid[pid] = RankHealth(local_rank, global_rank, pid, attached_at=now)
        self._arm(rank, now)
        return rank

    def pids(self) -> set[int]:
        """Every pid that speaks for a rank now (ranks and their adopted descendants)."""
        return set(self._by_pid)

    def rank_of(self, pid: int) -> RankHealth | None:
        return self._by_pid.get(pid)

    def ranks(self) -> list[RankHealth]:
        return list({id(rank): rank for rank in self._by_pid.values()}.values())

    def adopt(self, pid: int, rank: RankHealth) -> None:
        """Messages from `pid` (a descendant of the rank) count as the rank's own."""
        self._by_pid[pid] = rank

    def set_timeouts(
        self, timeouts: RankTimeouts, connect: float | EllipsisType | None = ...
    ) -> None:
        """`connect`: a new connect_timeout (set by hand, never learned); `...`: as it was."""
        self.timeouts = timeouts
        if not isinstance(connect, EllipsisType):
            self.connect_timeout = connect
        self.section_names.include(timeouts.rank_section_timeouts)
        now = self._clock.now()
        for rank in self.ranks():
            self._disarm(rank)
            self._arm(rank, now)

    # -- messages ----------------------------------------------------------------------------

    def on_hello(self, rank: RankHealth, stack_signal: int | None, now: float) -> None:
        if rank.connected_at is None:
            rank.connected_at = now
            rank.out_of_section_since = now
        rank.done = False
        rank.last_seen = now
        rank.stack_signal = stack_signal  # a catchable one (wire.decode)
        self._rearm_if_earlier(rank, now)

    def on_progress_link(self, rank: RankHealth, stack_signal: int | None) -> None:
        """The rank's progress observer (no sign of life: its own thread) registered its
        stack dump, where the script's own client has not."""
        if rank.stack_signal is None:
            rank.stack_signal = stack_signal

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
        if rank.first_step_at is None:
            self._first_step(rank, now)
        # Only the heartbeat limit moved (later, or from the initial to the subsequent one).
        limit = self.timeouts.rank_heartbeat_timeout
        if rank.armed_at is None or (limit is not None and now + limit < rank.armed_at):
            self._rearm_if_earlier(rank, now)

    def on_sequence(self, rank: RankHealth, link: Link, seq: int | None, dropped: object) -> int:
        """The message numbered `seq` arrived on `link`; how many before it were lost (their
        connection's sections are untimed until its state arrives). `dropped` is the rank's
        own count, when it sent one."""
        lost = link.advance(seq)
        lose(rank, link.id, lost)
        if isinstance(dropped, int):
            rank.dropped_by_link[link.id] = dropped
        return lost

    def on_section_start(
        self,
        rank: RankHealth,
        name: str,
        now: float,
        link: int = NO_LINK,
        at: float | None = None,
    ) -> None:
        """`at`: when the rank opened it (its send time), if it said; else `now`."""
        self._ensure_connected(rank, now)
        rank.last_seen = now
        at = now if at is None else at
        known = link not in rank.unknown_links
        if known and not rank.open_sections and rank.out_of_section_since is not None:
            self.observed.see(OUT_OF_SECTION, max(at - rank.out_of_section_since, 0.0))
        try:
            open_section(rank, name, link, at, self.section_names, heard=now)
        finally:
            if rank.first_step_at is None:
                self._first_step(rank, now)
            self._rearm_if_earlier(rank, now)

    def on_section_end(
        self,
        rank: RankHealth,
        name: str,
        now: float,
        link: int = NO_LINK,
        synced: bool = False,
        at: float | None = None,
    ) -> None:
        """`synced`: the message carries its connection's state (a section not open is one
        whose start was lost, not an error); `at`: when the rank closed it, if it said."""
        self._ensure_connected(rank, now)
        rank.last_seen = now
        at = now if at is None else at
        known = link not in rank.unknown_links and rank.section_links.get(name) == link
        started = close_section(rank, name, at, heard=now)
        self._rearm_if_earlier(rank, now)
        if started is None and not synced:
            raise ProtocolError("section_not_open", f"end of section {name!r} that is not open")
        if started is not None and known:
            self.observed.see(name, max(at - started, 0.0))

    def on_state(
        self,
        rank: RankHealth,
        link: int,
        state: Sequence[str],
        now: float,
        fresh: bool,
        at: float | None = None,
    ) -> list[BudgetExceeded]:
        """The sections open on `link` are exactly `state` as of `at` (its send time; else
        `now`); rank_sync.apply_state; `fresh`: their clocks restart. What a budget refused."""
        as_of = now if at is None else at
        refused = apply_state(rank, link, state, as_of, self.section_names, fresh, heard=now)
        self._rearm_if_earlier(rank, now)
        return refused

    def on_resumed(self, rank: RankHealth, now: float) -> None:
        """The rank says it is training again (after a restart): a first step, a sign of life."""
        self._ensure_connected(rank, now)
        rank.last_seen = now
        if rank.first_step_at is None:
            self._first_step(rank, now)

    def _first_step(self, rank: RankHealth, now: float) -> None:
        rank.first_step_at = now
        if self.on_first_step is not None:
            self.on_first_step(rank, now)

    def on_goodbye(self, rank: RankHealth) -> None:
        """The rank stopped monitoring itself (shutdown): nothing more is timed for it."""
        self._disarm(rank)
        rank.done = True

    # -- deadlines ---------------------------------------------------------------------------

    def _ensure_connected(self, rank: RankHealth, now: float) -> None:
        if rank.connected_at is None:  # a message before (or without) the handshake
            self.on_hello(rank, rank.stack_signal, now)

    def section_timed(self, rank: RankHealth) -> bool:
        """Whether `rank` is inside a section with a timeout in force (that timeout judges it,
        not the progress deadline: docs/architecture.md, which verdict when)."""
        sections = self.timeouts.rank_section_timeouts
        return any(sections.get(name) is not None for name in rank.open_sections)

    def _rearm_if_earlier(self, rank: RankHealth, now: float) -> None:
        """Keep the timer at or before the rank's earliest deadline (never later)."""
        deadline = next_deadline(rank, self.timeouts, self.connect_timeout)
        if deadline is not None and (rank.armed_at is None or deadline.at < rank.armed_at):
            self._disarm(rank)
            self._arm_at(rank, deadline.at, now)

    def _arm(self, rank: RankHealth, now: float) -> None:
        deadline = next_deadline(rank, self.timeouts, self.connect_timeout)
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
        """The timer's boundary: an error of ours fails the attempt (on_error) rather than
        leaving a rank untimed."""
        try:
            containment.inject("monitor")
            self._on_deadline(rank)
        except Exception as error:
            reason = containment.record("monitor", error)
            if self.on_error is not None:
                self.on_error(reason)

    def _on_deadline(self, rank: RankHealth) -> None:
        armed_at = rank.armed_at
        rank.timer = rank.armed_at = None
        now = self._clock.now()
        deadline = next_deadline(rank, self.timeouts, self.connect_timeout)
        if deadline is not None and deadline.at <= now and self.drain is not None:
            self.drain()  # a heartbeat queued behind this timer is a sign of life
            if rank.timer is not None:  # the drain re-armed it
                return
            deadline = next_deadline(rank, self.timeouts, self.connect_timeout)
            if deadline is not None and self._waits_for_state(rank, deadline, now):
                return
        if deadline is None:
            return
        if deadline.at > now:
            self._arm_at(rank, deadline.at, now)
            return
        if armed_at is not None and now - armed_at > STALL_THRESHOLD_S:
            self._grace_after_stall(now, now - armed_at)
            return
        self._judge(now, deadline)

    def on_backlog(self, rank: RankHealth, now: float) -> None:
        """The daemon just read a backlog of the rank's messages: its queue may have been full,
        and a message dropped, until now."""
        rank.backlog_at = now

    def _waits_for_state(self, rank: RankHealth, deadline: Deadline, now: float) -> bool:
        """A rank whose queue was read full moments ago may have dropped a message since (there
        was no room): its state, which it retries every RETRY_S, comes once the read made room.
        A deadline due for such a rank waits until RESYNC_GRACE_S after that read, once."""
        if rank.backlog_at is None or rank.deferred_deadline == deadline.at:
            return False
        until = rank.backlog_at + RESYNC_GRACE_S
        if until <= now:
            return False
        rank.deferred_deadline = deadline.at
        self._disarm(rank)
        self._arm_at(rank, until, now)
        return True

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
            if rank.hung or rank.done:
                continue
            rank.timed_afresh(now)
            self._disarm(rank)
            self._arm(rank, now)

    def _judge(self, now: float, due: Deadline) -> None:
        """Every rank overdue now or within one heartbeat interval is judged together."""
        window = min(self._recent_interval, BLAME_WINDOW_MAX_S, BLAME_WINDOW_FRACTION * due.timeout)
        overdue: list[Overdue] = []
        for rank in self.ranks():
            deadline = next_deadline(rank, self.timeouts, self.connect_timeout)
            if deadline is None or deadline.at > now + window:
                continue
            waiting = rank.armed_at is not None and rank.armed_at > now
            if waiting and rank.deferred_deadline == deadline.at:
                continue  # its state may be on its way (_waits_for_state)
            if self._waits_for_state(rank, deadline, now):
                continue
            overdue.append(Overdue(rank, deadline))
        if not overdue:
            return
        for item in overdue:
            item.rank.hung = True
            self._disarm(item.rank)
        self._on_hang(Verdict(tuple(order_by_silence(overdue)), now))
