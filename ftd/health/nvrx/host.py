"""What NVRx's own rank client gets from ftd: its RankMonitorServer's answers, on ftd's monitor.

ftd/health/nvrx/server.py reads NVRx's sockets and decodes its messages (ftd/health/nvrx/wire.py);
this module answers them through the HealthService: the same ranks, timeouts and workload
requests as ftd_client's, with what each NVRx release expects of its monitor
(ftd/health/nvrx/session.py: which messages get a reply, the time before the first step, the
warm-up steps).
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any, Protocol

from ftd_client.protocol import WorkloadAction
from pydantic import ValidationError

from ftd.config.ft import FaultToleranceConfig, RankTimeouts
from ftd.health.links import RankHealth
from ftd.health.monitor import Monitor
from ftd.health.nvrx import wire as nvrx_wire
from ftd.health.nvrx.session import BEFORE_STEP, BEFORE_STEP_LINK, STEP, ClientSession

log = logging.getLogger("ftd.nvrx")


class RankHealthKeeper(Protocol):
    """What of the node's rank health NVRx's messages act on (the HealthService's)."""

    ft: FaultToleranceConfig
    monitor: Monitor

    @property
    def timeouts(self) -> RankTimeouts: ...

    def rank_for(self, pid: int) -> RankHealth: ...

    def set_calculated(
        self, timeouts: RankTimeouts, by: str, learned: set[str], unlearned: set[str]
    ) -> None: ...

    def workload(self, rank: RankHealth, action: WorkloadAction, description: str) -> None: ...


class NvrxRankHost:
    """The NvrxServer's host (ftd/health/nvrx/server.py NvrxHost) for one HealthService."""

    def __init__(self, health: RankHealthKeeper) -> None:
        self._health = health
        self._unknown_said: set[str] = set()
        """The message kinds whose unknown fields were logged (once each, for the daemon)."""

    def nvrx_authorize(self, pid: int) -> None:
        self._health.rank_for(pid)

    def nvrx_message(
        self, session: ClientSession, message: nvrx_wire.Record, now: float
    ) -> bytes | None:
        """What NVRx's RankMonitorServer does with each message, on ftd's monitor; the reply,
        or None where the client reads none."""
        rank = self._health.rank_for(session.pid)
        kind = type(message).__name__
        if message.unknown_fields and kind not in self._unknown_said:
            self._unknown_said.add(kind)
            log.info(
                "NVRx client of rank %d sends fields ftd does not know (ignored): %s %s",
                rank.global_rank,
                kind,
                sorted(message.unknown_fields),
            )
        if isinstance(message, nvrx_wire.InitMsg):
            self._init(rank, session, message, now)
            return nvrx_wire.ok(cfg=self._config(session))
        if isinstance(message, nvrx_wire.HeartbeatMsg):
            self._health.monitor.on_heartbeat(rank, now)
            return nvrx_wire.ok() if session.replies_to_beats else None
        if isinstance(message, nvrx_wire.SectionMsg):
            failure = self._section(rank, session, message, now)
            if session.replies_to_beats:
                return nvrx_wire.ok() if failure is None else nvrx_wire.error(failure)
            if failure is not None and session.say_once(failure):  # NVRx's monitor logs it too
                log.warning(
                    "NVRx client of rank %d: %s (the client reads no reply; further ones "
                    "of this kind are not logged)",
                    rank.global_rank,
                    failure,
                )
            return None
        if isinstance(message, nvrx_wire.UpdateConfigMsg):
            self._update(rank, message)
        return nvrx_wire.ok()

    def _init(
        self, rank: RankHealth, session: ClientSession, message: nvrx_wire.InitMsg, now: float
    ) -> None:
        monitor = self._health.monitor
        monitor.on_hello(rank, None, now)  # NVRx's client registers no stack dump
        self._end_before_step(rank, session, now)
        session.started(message, self._health.timeouts.rank_section_timeouts)
        if session.before_step:
            monitor.on_state(rank, BEFORE_STEP_LINK, [BEFORE_STEP], now, fresh=True)

    def _section(
        self, rank: RankHealth, session: ClientSession, message: nvrx_wire.SectionMsg, now: float
    ) -> str | None:
        """The section message applied to the monitor; what NVRx's monitor would answer with
        an ErrorMsg, or None."""
        monitor = self._health.monitor
        name, action = message.section, message.action
        session.saw(name, message.iteration)
        if action is nvrx_wire.SectionAction.CLOSE_ALL:
            for open_name in list(rank.open_sections):
                if open_name != BEFORE_STEP:
                    monitor.on_section_end(rank, open_name, now)
            session.step_as = None
            return None
        if name is None:
            return "a section name is required"
        if action is nvrx_wire.SectionAction.OPEN:
            open_as = session.step_as if name == STEP else name
            if open_as is not None and open_as in rank.open_sections:
                return f"Section '{name}' is already open."
            timed_as = session.step_name(self._health.timeouts.rank_section_timeouts)
            monitor.on_section_start(rank, timed_as if name == STEP else name, now)
            if name == STEP:
                session.step_as = timed_as
                self._end_before_step(rank, session, now)
            return None
        open_as = session.step_as if name == STEP else name
        if open_as is None or open_as not in rank.open_sections:
            return f"Section '{name}' is not open."
        monitor.on_section_end(rank, open_as, now)
        if name == STEP:
            session.step_as = None
        return None

    def _end_before_step(self, rank: RankHealth, session: ClientSession, now: float) -> None:
        """BEFORE_STEP closes (if open): a step opened, or the client started again."""
        if session.before_step:
            session.before_step = False
            if BEFORE_STEP in rank.open_sections:
                self._health.monitor.on_section_end(rank, BEFORE_STEP, now)

    def _update(self, rank: RankHealth, message: nvrx_wire.UpdateConfigMsg) -> None:
        """Timeouts the NVRx client calculated (the same on every rank: it reduced its
        observations across ranks first). Calculated values count as learned ones."""
        patch: dict[str, Any] = {}
        learned: set[str] = set()
        unlearned: set[str] = set()
        if (hb := message.hb_timeouts) is not None:
            patch["initial_rank_heartbeat_timeout"] = hb.initial
            patch["rank_heartbeat_timeout"] = hb.subsequent
            names = {"initial_rank_heartbeat_timeout", "rank_heartbeat_timeout"}
            (learned if hb.were_calculated else unlearned).update(names)
        if (sections := message.section_timeouts) is not None:
            patch["rank_section_timeouts"] = dict(sections.section)
            patch["rank_out_of_section_timeout"] = sections.out_of_section
            keys = {f"section:{name}" for name in sections.section}
            calculated = {f"section:{name}" for name in sections.calculated_sections}
            learned |= calculated & keys
            unlearned |= keys - calculated
            oos = "rank_out_of_section_timeout"
            (learned if sections.is_out_of_section_calculated else unlearned).add(oos)
        floor = self._health.ft.min_learned_timeout  # as for timeouts the daemon learns itself
        for name in learned:
            if name.startswith("section:"):
                section = name.removeprefix("section:")
                patch["rank_section_timeouts"][section] = _at_least(
                    patch["rank_section_timeouts"][section], floor
                )
            else:
                patch[name] = _at_least(patch[name], floor)
        try:
            timeouts = RankTimeouts.model_validate({**self._health.timeouts.model_dump(), **patch})
        except ValidationError as error:
            raise nvrx_wire.Refused("bad_timeouts", str(error).splitlines()[0]) from None
        by = f"rank {rank.global_rank} (NVRx client)"
        self._health.set_calculated(timeouts, by, learned, unlearned)

    def _config(self, session: ClientSession) -> nvrx_wire.Ref:
        """NVRx's FaultToleranceConfig as its client reads it: the timeouts in force, whether
        it reads replies to its heartbeats and sections (ftd/health/nvrx/session.py), no
        exception hook of NVRx's (ftd reads a failed rank's error file and its output)."""
        timeouts = self._health.timeouts
        return nvrx_wire.Ref(
            nvrx_wire.CONFIG_MODULE,
            "FaultToleranceConfig",
            {
                "workload_check_interval": self._health.ft.workload_check_interval,
                "initial_rank_heartbeat_timeout": timeouts.initial_rank_heartbeat_timeout,
                "rank_heartbeat_timeout": timeouts.rank_heartbeat_timeout,
                "rank_section_timeouts": dict(timeouts.rank_section_timeouts),
                "rank_out_of_section_timeout": timeouts.rank_out_of_section_timeout,
                "node_health_check_interval": 5.0,
                "safety_factor": self._health.ft.safety_factor,
                "rank_termination_signal": nvrx_wire.EnumRef(
                    "signal",
                    "Signals",
                    int(signal.Signals[self._health.ft.rank_termination_signal]),
                ),
                "log_level": logging.getLevelNamesMapping().get(
                    self._health.ft.log_level.upper(), logging.INFO
                ),
                "restart_check_interval": 60.0,
                "enable_nic_monitor": False,
                "pci_topo_file": None,
                "link_down_path_template": None,
                "skip_section_response": not session.replies_to_beats,
                "install_exception_hook": False,
                "num_warmup_iterations": session.warmup_iterations,
            },
        )

    def nvrx_disconnected(self, session: ClientSession) -> None:
        """NVRx's monitor stops timing a rank whose connection closed."""
        rank = self._health.monitor.rank_of(session.pid)
        if rank is not None:
            self._end_before_step(rank, session, time.monotonic())
            self._health.monitor.on_goodbye(rank)

    def nvrx_workload_control(self, pid: int, request: nvrx_wire.WorkloadControlRequest) -> None:
        action = {
            nvrx_wire.WorkloadAction.Continue: WorkloadAction.CONTINUE,
            nvrx_wire.WorkloadAction.ExcludeThisNode: WorkloadAction.EXCLUDE_THIS_NODE,
            nvrx_wire.WorkloadAction.ShutdownWorkload: WorkloadAction.SHUTDOWN_WORKLOAD,
        }[request.action]
        self._health.workload(self._health.rank_for(pid), action, request.description)


def _at_least(value: float | None, floor: float) -> float | None:
    return None if value is None else max(value, floor)
