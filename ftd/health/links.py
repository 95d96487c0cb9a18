"""One rank's health state and its nearest deadline, as pure functions of (state, timeouts).

A rank has up to four clocks: the wait for its first contact and first heartbeat, the interval
between heartbeats, each open section, and the time out of any section. `next_deadline` gives
the nearest of those that the timeouts set; the monitor keeps one timer on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ftd.config.ft import RankTimeouts


class Cancellable(Protocol):
    def cancel(self) -> None: ...


@dataclass(eq=False)  # identity: one object per rank, shared by the pids that speak for it
class RankHealth:
    local_rank: int
    global_rank: int
    pid: int
    attached_at: float | None = None
    """When the daemon started watching the rank (it was just started)."""
    connected_at: float | None = None
    """Monotonic time of the handshake; None while the rank has not contacted the daemon."""
    done: bool = False
    """The rank said goodbye: it is no longer timed."""
    stack_signal: int | None = None
    last_heartbeat: float | None = None
    last_seen: float | None = None
    """The rank's last sign of life: its newest message of any kind."""
    first_step_at: float | None = None
    """Its first heartbeat, section start or resumed(): the rank is training."""
    open_sections: dict[str, float] = field(default_factory=dict)
    """Open section -> when it opened (monotonic)."""
    section_seen: dict[str, float] = field(default_factory=dict)
    """Open section -> when the daemon learned it was open (a backlog: later than it opened)."""
    section_links: dict[str, int] = field(default_factory=dict)
    """Open section -> the connection (Link.id) whose state it belongs to."""
    unknown_links: set[int] = field(default_factory=set)
    """Connections that lost messages and have not sent their state since: their sections
    (and the time out of any section) are not timed until they do."""
    lost_messages: int = 0
    """Messages the daemon knows it missed (gaps in the sequence numbers)."""
    dropped_by_link: dict[int, int] = field(default_factory=dict)
    """What each connection said it dropped (its `dropped`): the rank's own count."""
    out_of_section_since: float | None = None
    out_of_section_seen: float | None = None
    """When the daemon learned the rank had left its last section."""
    hung: bool = False
    simulated_hang: bool = False
    """The rank announced an injected hang (ft_config simulated_fault, POST /v1/faults)."""
    timer: Cancellable | None = None
    armed_at: float | None = None
    backlog_at: float | None = None
    """When the daemon last read a backlog of this rank's messages (Monitor.on_backlog)."""
    deferred_deadline: float | None = None
    """The deadline whose verdict already waited once for the rank's state (Monitor._defer)."""

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
            "dropped_messages": self.dropped_messages,
        }

    def timed_afresh(self, now: float) -> None:
        """Every clock of the rank starts again at `now` (the daemon did not run for a while:
        nobody can say who was silent then)."""
        self.attached_at = now
        if self.connected_at is None:
            return
        if self.last_heartbeat is None:
            self.connected_at = now
        else:
            self.last_heartbeat = now
        self.open_sections = dict.fromkeys(self.open_sections, now)
        self.section_seen = dict.fromkeys(self.open_sections, now)
        if self.out_of_section_since is not None:
            self.out_of_section_since = self.out_of_section_seen = now

    @property
    def dropped_messages(self) -> int:
        """Messages of this rank that never reached the daemon: the rank's count where it told
        us, else the gaps the daemon saw."""
        return max(self.lost_messages, sum(self.dropped_by_link.values()))

    def section_timed(self, name: str) -> bool:
        return self.section_links.get(name) not in self.unknown_links


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
            "never_connected": "never contacted the daemon within initial_rank_heartbeat_timeout "
            "(no ftd_client, or stuck before it started)",
            "initial_heartbeat": "sent no first heartbeat within initial_rank_heartbeat_timeout",
            "heartbeat": "sent no heartbeat within rank_heartbeat_timeout",
            "section": f"stayed in section {self.section!r} past its timeout",
            "out_of_section": "stayed out of any section past rank_out_of_section_timeout",
        }[self.kind]
        # a timer may fire a hair before its deadline: that is no negative lateness
        overdue_ms = max(0.0, 1000 * (now - self.at))
        return (
            f"rank {rank.global_rank} (local {rank.local_rank}, pid {rank.pid}) hung: {what} "
            f"({self.timeout:g}s; overdue by {overdue_ms:.1f} ms)"
        )


RESYNC_GRACE_S = 0.25
"""How long a verdict waits for a rank's retried state (ftd_client's slowest retry is 0.1 s):
after the daemon learned of a section that a backlog held back, and after a drain that found
the rank's queue full (Monitor._defer): the rank may have dropped a message since."""


def _not_before_heard(due: float, heard: float | None, limit: float) -> float:
    """A section's clock runs from when the rank opened it; but a section the daemon heard of
    late (behind a backlog) is judged no sooner than RESYNC_GRACE_S (or its whole timeout, if
    shorter) after it was heard: its end may have been dropped meanwhile, and is retried."""
    if heard is None:
        return due
    return max(due, heard + min(limit, RESYNC_GRACE_S))


def next_deadline(
    rank: RankHealth, timeouts: RankTimeouts, connect_timeout: float | None = None
) -> Deadline | None:
    """The rank's nearest deadline under `timeouts`, or None when nothing is being timed.
    `connect_timeout` bounds the time from the rank's start to its first contact: the initial
    heartbeat timeout as configured (a learned one measures contact → first heartbeat only)."""
    if rank.hung or rank.done:
        return None
    if rank.connected_at is None:
        if rank.attached_at is None or connect_timeout is None:
            return None
        return Deadline(rank.attached_at + connect_timeout, "never_connected", connect_timeout)
    candidates: list[Deadline] = []
    if rank.last_heartbeat is None:
        if (limit := timeouts.initial_rank_heartbeat_timeout) is not None:
            candidates.append(Deadline(rank.connected_at + limit, "initial_heartbeat", limit))
    elif (limit := timeouts.rank_heartbeat_timeout) is not None:
        candidates.append(Deadline(rank.last_heartbeat + limit, "heartbeat", limit))
    for name, started in rank.open_sections.items():
        if (limit := timeouts.rank_section_timeouts.get(name)) is not None and (
            not rank.unknown_links or rank.section_timed(name)
        ):
            at = _not_before_heard(started + limit, rank.section_seen.get(name), limit)
            candidates.append(Deadline(at, "section", limit, name))
    limit = timeouts.rank_out_of_section_timeout
    since = rank.out_of_section_since
    if since is not None and not rank.open_sections and not rank.unknown_links and limit:
        at = _not_before_heard(since + limit, rank.out_of_section_seen, limit)
        candidates.append(Deadline(at, "out_of_section", limit))
    return min(candidates, key=lambda deadline: deadline.at, default=None)


@dataclass(slots=True, eq=False)
class Link:
    """One rank connection as the health service sees it: whose it is, and how far its
    sequence numbers have come (protocol.py: `s`)."""

    id: int
    pid: int
    last_seq: int = 0
    backlog_at: float | None = None
    """When the daemon last read BACKLOG_MESSAGES or more from this connection in one go."""

    def advance(self, seq: int | None) -> int:
        """Take the message numbered `seq`; how many messages before it were lost. A number
        at or below the last one (a forked child writing on an inherited socket) loses
        nothing and moves nothing."""
        if seq is None:
            return 0
        lost = seq - self.last_seq - 1
        if seq > self.last_seq:
            self.last_seq = seq
        return max(lost, 0)
