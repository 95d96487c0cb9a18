"""What one decoded rank message does to its rank's health: the lossy path's part of it.

`deliver` takes a rank's message as the door read it (ftd_client.wire.Envelope) on a
connection, checks its sequence number, applies its event (heartbeat, section start or end,
resumed, goodbye) and then its state (the sections open on that connection), and says what
was lost and what a budget refused. Requests that are answered (hello, workload control,
timeouts) stay with the health service. Pure apart from the monitor it drives, so the lossy
channel's property tests run it on a fake clock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ftd_client import protocol
from ftd_client.messages import Fault, Goodbye, Heartbeat, Resumed, SectionEnd, SectionStart
from ftd_client.protocol import ProtocolError, WorkloadAction
from ftd_client.wire import Envelope

from ftd.health.links import Link, RankHealth
from ftd.health.monitor import STALL_THRESHOLD_S, Monitor
from ftd.health.sync import BudgetExceeded
from ftd.health.unix_socket import parent_pid
from ftd.status.event_kind import EventKind
from ftd.status.events import EventLog

log = logging.getLogger("ftd.health")

MAX_BACKLOG_S = 30.0
"""A message older than this when read is timed from 30 s before its receipt."""


@dataclass
class Delivery:
    lost: int = 0
    """Messages of this connection that never arrived before this one."""
    refused: list[BudgetExceeded] = field(default_factory=list)


def deliver(
    monitor: Monitor,
    rank: RankHealth,
    link: Link,
    envelope: Envelope,
    now: float,
    reading_since: float | None = None,
) -> Delivery:
    """Apply `envelope` (received on `link` at `now`; the daemon has been reading without a
    pause since `reading_since`). A budget's refusal of its event is in `refused`, never
    raised: the state it carries is applied all the same."""
    delivery = Delivery(monitor.on_sequence(rank, link, envelope.seq, envelope.dropped))
    at = sent_at(envelope.sent_ns, now, reading_since)
    try:
        _apply_event(monitor, rank, link, envelope, now, at)
    except BudgetExceeded as error:
        delivery.refused.append(error)
    if envelope.open is not None:
        # After a drop (`dropped` rides along) what stayed open may have closed and opened
        # again unseen: its clock restarts when the rank said so.
        fresh = envelope.dropped is not None
        for refusal in monitor.on_state(rank, link.id, envelope.open, now, fresh, at):
            if all(refusal.budget != seen.budget for seen in delivery.refused):
                delivery.refused.append(refusal)  # one refusal per budget and message
    return delivery


def _apply_event(
    monitor: Monitor, rank: RankHealth, link: Link, envelope: Envelope, now: float, at: float
) -> None:
    match envelope.message:
        case Heartbeat():
            monitor.on_heartbeat(rank, now)
        case SectionStart(name=name):
            monitor.on_section_start(rank, name, now, link.id, at)
        case SectionEnd(name=name):
            monitor.on_section_end(rank, name, now, link.id, envelope.open is not None, at)
        case Resumed():
            monitor.on_resumed(rank, now)
        case Goodbye():
            monitor.on_goodbye(rank)
        case _:  # the state, and the answered kinds: their state only, here
            pass


def sent_at(sent_ns: int | None, now: float, reading_since: float | None = None) -> float:
    """When the rank sent a message (its CLOCK_MONOTONIC, the daemon's too), as far back as
    the daemon has been reading without a pause (`reading_since`, at most MAX_BACKLOG_S ago;
    else STALL_THRESHOLD_S): a backlog does not delay a section's clock, and a daemon, or a
    machine, that was not running gives a grace instead of deadlines in the past."""
    if sent_ns is None:
        return now
    earliest = now - STALL_THRESHOLD_S if reading_since is None else reading_since
    return min(now, max(sent_ns / 1e9, earliest, now - MAX_BACKLOG_S))


class WorkloadRequest:
    def __init__(self, action: WorkloadAction, global_rank: int, description: str) -> None:
        self.action, self.global_rank, self.description = action, global_rank, description

    def reason(self) -> str:
        what = {
            WorkloadAction.SHUTDOWN_WORKLOAD: "asked to shut the workload down",
            WorkloadAction.EXCLUDE_THIS_NODE: "asked to exclude its node",
            WorkloadAction.CONTINUE: "asked to continue",
        }[self.action]
        detail = f": {self.description}" if self.description else ""
        return f"rank {self.global_rank} {what}{detail}"


def workload_requested(
    events: EventLog, rank: int, action: WorkloadAction, description: str
) -> WorkloadRequest | None:
    """A rank's workload-control request, recorded; the request unless it asks to continue."""
    request = WorkloadRequest(action, rank, description[: protocol.MAX_DESCRIPTION])
    events.emit_for_rank(
        rank,
        EventKind.WORKLOAD_CONTROL,
        action=action.name,
        rank=rank,
        description=request.description,
    )
    if action is WorkloadAction.CONTINUE:
        return None
    log.warning("%s", request.reason())
    return request


def fault_injected(events: EventLog, rank: RankHealth, fault: Fault) -> None:
    """A rank says it carries out a simulated fault (ftd_client.faults)."""
    rank.simulated_hang = rank.simulated_hang or fault.kind == "hang"
    log.warning("rank %d is carrying out a simulated %s fault", rank.global_rank, fault.kind)
    events.emit_for_rank(
        rank.global_rank,
        EventKind.FAULT_INJECTED,
        kind=fault.kind,
        global_rank=rank.global_rank,
        pid=rank.pid,
        open_sections=sorted(rank.open_sections),
    )


MAX_ANCESTRY = 16


def rank_of_process(monitor: Monitor, pid: int) -> RankHealth:
    """The rank a process is, or descends from (a DataLoader worker, say); ProtocolError for
    a process that is neither."""
    rank = monitor.rank_of(pid)
    if rank is not None:
        return rank
    ancestor: int | None = pid
    for _ in range(MAX_ANCESTRY):
        ancestor = parent_pid(ancestor) if ancestor else None
        if not ancestor or ancestor == 1:
            break
        if (rank := monitor.rank_of(ancestor)) is not None:
            monitor.adopt(pid, rank)
            return rank
    raise ProtocolError("not_a_rank", f"pid {pid} is no rank of this daemon")
