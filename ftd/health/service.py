"""Rank health service: the socket, the monitor, the timeouts and workload requests.

The daemon owns one; it handles the ranks' messages (the inbox's table), answers requests,
turns hang verdicts into explained failures (stacks first, then the kill: hangs.py) and keeps
the timeouts in force through their one writer (timeouts_keeper.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ftd_client.messages import (
    CalculateTimeouts,
    Fault,
    Goodbye,
    Heartbeat,
    Hello,
    ProgressReport,
    Resumed,
    SectionEnd,
    SectionStart,
    SetTimeouts,
    State,
    TimeoutValue,
    WorkloadControl,
)
from ftd_client.protocol import WorkloadAction
from ftd_client.wire import Envelope, Message

from ftd.config.ft import FaultToleranceConfig, RankTimeouts
from ftd.errors import InvalidRequest
from ftd.health.accounting import BudgetWatch, LossWatch, send_buffer_bytes
from ftd.health.collectives import NodeCollectives
from ftd.health.first_steps import FirstSteps
from ftd.health.hangs import HangHandler
from ftd.health.inbox import Handler, Inbox
from ftd.health.learning import load_learned
from ftd.health.links import Link, RankHealth
from ftd.health.messages import (
    WorkloadRequest,
    deliver,
    fault_injected,
    rank_of_process,
    sent_at,
    workload_requested,
)
from ftd.health.monitor import Monitor
from ftd.health.nvrx.host import NvrxRankHost
from ftd.health.nvrx.server import NvrxServer
from ftd.health.progress import DEFAULT_FLOOR_S, ProgressWatch
from ftd.health.progress_timer import ProgressTimer
from ftd.health.socket import RankSocketServer, Reply, rank_socket_refusals
from ftd.health.sync import BudgetExceeded
from ftd.health.timeouts_keeper import TimeoutsKeeper
from ftd.ranks.workers import WorkerGroup
from ftd.status.events import EventLog
from ftd.status.model import RankStatus
from ftd.status.persist import Persistence

log = logging.getLogger("ftd.health")


class HealthService:
    def __init__(
        self,
        ft: FaultToleranceConfig,
        socket_path: Path,
        state_file: Path,
        events: EventLog,
        persist: Persistence | None = None,
        progress: ProgressWatch | None = None,
        handlers: Mapping[type[Message], Handler] | None = None,
        first_steps: FirstSteps | None = None,
    ) -> None:
        """`handlers`: the other parts' (the checkpoint holder's), by kind, for the inbox;
        `first_steps`: told of each rank's first step after a restart (the restart's end)."""
        self.ft = ft
        self.state_file = state_file
        self.events = events
        self.persist = persist or Persistence()
        self.workload_request: WorkloadRequest | None = None
        self.losses = LossWatch(events)
        self.budgets = BudgetWatch(events)
        timeouts, learned = load_learned(state_file, ft.timeouts())
        self.monitor = Monitor(
            timeouts,
            lambda verdict: self.hangs.on_hang(verdict),
            drain=lambda: self.server.drain(),
            on_error=lambda reason: self.hangs.fail(reason),
            on_first_step=lambda rank, now: self.first_steps.stepped(rank.local_rank, now),
            connect_timeout=ft.initial_rank_heartbeat_timeout,  # as configured, never learned
        )
        self.progress = progress or ProgressWatch(DEFAULT_FLOOR_S)
        self.first_steps = first_steps or FirstSteps(self.progress.node)
        self.timeouts_keeper = TimeoutsKeeper(
            ft, self.monitor, learned, events, self.persist, state_file
        )
        self.hangs = HangHandler(self.monitor, events, ft.rank_termination_signal, self.progress)
        self.inbox = Inbox(self.monitor, self.losses, {**self._handlers(), **(handlers or {})})
        dropped, previous_pids = rank_socket_refusals(), set[int]()
        self.nvrx = NvrxServer(socket_path, NvrxRankHost(self), dropped, previous_pids)
        self.server = RankSocketServer(
            socket_path,
            self.inbox,
            self.rank_for,
            self._link_closed,
            (self.nvrx,),
            dropped,
            previous_pids,
        )
        self._progress_timer = ProgressTimer(
            self.progress,
            self.server.drain,
            self.hangs.on_progress_hang,
            self.hangs.fail,
            self.monitor.section_timed,
        )
        self._group: WorkerGroup | None = None

    @property
    def timeouts(self) -> RankTimeouts:
        return self.monitor.timeouts

    def start(self) -> None:
        self.server.start()
        self._progress_timer.start()
        log.info("the ranks' socket is %s", self.server.path)
        loop = asyncio.get_running_loop()
        try:
            self.nvrx.start(loop.add_reader, loop.remove_reader)
        except OSError as error:  # ftd_client's socket still serves; NVRx's clients will fail
            log.error("NVRx's rank sockets are not served: %s", error)

    def close(self) -> None:
        self.monitor.detach()
        self.server.close()
        self.nvrx.close()
        self._progress_timer.close()
        self.hangs.close()

    # -- attempts ----------------------------------------------------------------------------

    def attach(self, group: WorkerGroup, statuses: list[RankStatus]) -> None:
        """Watch this attempt's ranks (the previous attempt's are forgotten)."""
        self._group = group
        self.hangs.attach(group)
        self.timeouts_keeper.new_attempt()  # its ranks count their `calc` calls from 1
        self.losses.forget()
        self.budgets.forget()
        self.progress.attach()
        self.monitor.attach(
            [(s.local_rank, s.global_rank, s.pid) for s in statuses if s.pid is not None]
        )
        self.first_steps.attach(group, {s.local_rank for s in statuses})

    def respawned(self, status: RankStatus, old_pid: int | None) -> None:
        """The rank's process was replaced (in-process mode): watch the new one."""
        if status.pid is not None:
            self.monitor.replace(old_pid, status.local_rank, status.global_rank, status.pid)

    def detach(self, group: WorkerGroup | None = None) -> None:
        """Stop watching `group`'s ranks (any group's when None); a later attempt's ranks,
        already attached, are left alone."""
        if group is not None and group is not self._group:
            return
        # What the ranks sent before they exited (their resumed(), a last section) is read
        # before their connections are forgotten: the exit may be seen before the messages.
        self.server.drain()
        self._group = None
        self.hangs.collectives.freeze(judged=False)  # unless its verdict froze them
        self.hangs.detach()
        # In place: NVRx's sockets share the set (a new one left them refusing as not_a_rank).
        previous = self.server.previous_pids
        previous.clear()
        previous.update(self.monitor.pids())
        self.server.forget_connections()
        self.monitor.detach()
        self.first_steps.detach()

    def collectives(self) -> NodeCollectives | None:
        """The node's part of the job's culprit as the last attempt ended (collectives.py)."""
        return self.hangs.collectives.frozen

    def send_buffer(self, local_ranks: int) -> int:
        """The send buffer each rank's socket should have (FTD_SOCKET_SNDBUF)."""
        return send_buffer_bytes(local_ranks, self.losses.peak_rate)

    def snapshot(self, pid: int | None) -> dict[str, Any] | None:
        """The live view of the rank with this pid (heartbeat age, open section), if watched."""
        rank = self.monitor.rank_of(pid) if pid is not None else None
        now = time.monotonic()
        return {**rank.snapshot(now), "progress": self.progress.view(rank, now)} if rank else None

    def timeouts_view(self) -> dict[str, Any]:
        return self.timeouts.model_dump()

    def ipc_view(self) -> dict[str, Any]:
        server = self.server
        return {
            "received": server.received,
            "dropped": dict(server.dropped),
            "stalls": self.monitor.stalls,
            "lost": self.losses.lost_total,
            "loss_episodes": self.losses.episodes,
            "budget_refusals": {**self.budgets.refused, **self.events.rank_budget.counts()},
        }

    # -- timeouts (the keeper's) ------------------------------------------------------------

    def learn(
        self, by: str, sections: list[str] | None = None, out_of_section: bool = True
    ) -> RankTimeouts:
        return self.timeouts_keeper.learn(by, sections, out_of_section)

    def update(self, patch: Mapping[str, object], by: str) -> RankTimeouts:
        """The operator's change (InvalidRequest when the timeouts' model refuses it)."""
        return self.timeouts_keeper.update(patch, by)

    def set_calculated(
        self, timeouts: RankTimeouts, by: str, learned: set[str], unlearned: set[str]
    ) -> None:
        self.timeouts_keeper.set_calculated(timeouts, by, learned, unlearned)

    # -- what an attempt asks of it ---------------------------------------------------------

    def rank_sockets(self) -> tuple[Path, tuple[Path, Path]]:
        """The ranks' socket, and NVRx's two (rank monitor, launcher) beside it."""
        return self.server.path, (self.nvrx.rank_monitor_path, self.nvrx.launcher_path)

    @contextlib.contextmanager
    def messages_held(self) -> Iterator[None]:
        """The ranks' messages wait, unread, while their processes start and are attached."""
        self.server.pause()
        try:
            yield
        finally:
            self.server.resume()

    async def explain_ranks(self, local_ranks: list[int]) -> list[str]:
        return await self.hangs.explain_ranks(local_ranks)

    # -- messages ----------------------------------------------------------------------------

    def rank_for(self, pid: int) -> RankHealth:
        return rank_of_process(self.monitor, pid)

    def _handlers(self) -> dict[type[Message], Handler]:
        """The kinds this service handles (the inbox's table, with the other parts')."""
        events = (Heartbeat, SectionStart, SectionEnd, Goodbye, Resumed, State)
        requests = (Hello, Fault, WorkloadControl, CalculateTimeouts, SetTimeouts)
        return {
            **dict.fromkeys(events, self._on_event),
            **dict.fromkeys(requests, self._on_request),
            ProgressReport: self._on_progress,
        }

    def _on_progress(self, rank: RankHealth, link: Link, envelope: Envelope, now: float) -> None:
        """An observation only: no sign of life."""
        report = envelope.message
        assert isinstance(report, ProgressReport)
        at = sent_at(envelope.sent_ns, now, self.server.reading_since)
        refused = self.progress.observe(rank, link.id, report, at)
        self.monitor.on_progress_link(rank, report.stack_signal)
        if report.steps and self.first_steps.waiting_for(rank.local_rank):  # the restart's end
            self.first_steps.stepped(rank.local_rank, at - (report.age_ms or 0) / 1000, step=True)
        if refused is not None:
            self.budgets.exceeded(rank, refused)
            raise refused  # counted by the socket as a dropped message

    def _on_event(self, rank: RankHealth, link: Link, envelope: Envelope, now: float) -> None:
        refused = self._deliver(rank, link, envelope, now)
        if refused:
            raise refused[0]  # counted by the socket as a dropped message

    def _on_request(
        self, rank: RankHealth, link: Link, envelope: Envelope, now: float
    ) -> Reply | None:
        """A message that asks more of the daemon than its health: answered after its state."""
        message = envelope.message
        if isinstance(message, Hello):  # before its state: the rank is connected
            self.monitor.on_hello(rank, message.stack_signal, now)
        refused = self._deliver(rank, link, envelope, now)
        reply = self._answer(rank, message, now)
        if refused:
            raise refused[0]  # counted by the socket as a dropped message
        return reply

    def _deliver(
        self, rank: RankHealth, link: Link, envelope: Envelope, now: float
    ) -> list[BudgetExceeded]:
        """Its sequence, event and state (messages.deliver); what a budget refused."""
        if link.backlog_at is not None and (rank.backlog_at or 0.0) < link.backlog_at:
            self.monitor.on_backlog(rank, link.backlog_at)
        delivery = deliver(self.monitor, rank, link, envelope, now, self.server.reading_since)
        if delivery.lost:
            self.losses.lost(rank, delivery.lost, now)
        for refusal in delivery.refused:
            self.budgets.exceeded(rank, refusal)
        return delivery.refused

    def _link_closed(self, link: Link) -> None:
        """A rank's connection ended: nothing can close its sections any more."""
        rank = self.monitor.rank_of(link.pid)
        if rank is not None:
            self.monitor.on_state(rank, link.id, [], time.monotonic(), fresh=False)
            self.progress.forget(rank, link.id)

    def _answer(self, rank: RankHealth, message: Message, now: float) -> Reply | None:
        match message:
            case Hello():
                return self.timeouts_keeper.reply(self.timeouts)
            case Fault():
                fault_injected(self.events, rank, message)
            case WorkloadControl(action=action, description=description):
                self.workload(rank, action, description)
                return {"ok": True}
            case CalculateTimeouts():
                return self.timeouts_keeper.calculate(rank, message, now)
            case SetTimeouts(timeouts=patch, learned=learned):
                try:
                    applied = self.timeouts_keeper.update(
                        {key: _plain(value) for key, value in patch.items()},
                        f"rank {rank.global_rank}",
                        frozenset(learned),
                        rank,
                    )
                except InvalidRequest as error:
                    return {"ok": False, "error": error.detail}
                return self.timeouts_keeper.reply(applied)
        return None

    def workload(self, rank: RankHealth, action: WorkloadAction, description: str) -> None:
        request = workload_requested(self.events, rank.global_rank, action, description)
        if request is not None:
            self.workload_request = request


def _plain(value: TimeoutValue) -> object:
    """A `set`'s value as the timeouts' model reads it."""
    return dict(value) if isinstance(value, Mapping) else value
