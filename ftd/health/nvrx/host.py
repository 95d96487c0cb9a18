"""What NVRx's own rank client gets from ftd: its RankMonitorServer's answers, on ftd's monitor.

ftd/health/nvrx/server.py reads NVRx's sockets and decodes its messages (ftd/health/nvrx/wire.py);
this
module answers them through the HealthService: the same ranks, timeouts and workload requests
as ftd_client's.
"""

from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING, Any

from ftd_client.protocol import WorkloadAction
from pydantic import ValidationError

from ftd.config.ft import RankTimeouts
from ftd.health.links import RankHealth
from ftd.health.nvrx import wire as nvrx_wire

if TYPE_CHECKING:
    from ftd.health.service import HealthService


class NvrxRankHost:
    """The NvrxServer's host (ftd/health/nvrx/server.py NvrxHost) for one HealthService."""

    def __init__(self, health: HealthService) -> None:
        self._health = health

    def nvrx_authorize(self, pid: int) -> None:
        self._health.rank_for(pid)

    def nvrx_message(self, pid: int, message: nvrx_wire.Record, now: float) -> bytes:
        """What NVRx's RankMonitorServer does with each message, on ftd's monitor."""
        rank = self._health.rank_for(pid)
        if isinstance(message, nvrx_wire.InitMsg):
            self._health.monitor.on_hello(rank, None, now)  # NVRx's client registers no stack dump
            return nvrx_wire.ok(cfg=self._config())
        if isinstance(message, nvrx_wire.HeartbeatMsg):
            self._health.monitor.on_heartbeat(rank, now)
        elif isinstance(message, nvrx_wire.SectionMsg):
            return self._section(rank, message, now)
        elif isinstance(message, nvrx_wire.UpdateConfigMsg):
            self._update(rank, message)
        return nvrx_wire.ok()

    def _section(self, rank: RankHealth, message: nvrx_wire.SectionMsg, now: float) -> bytes:
        name, action = message.section, message.action
        if action is nvrx_wire.SectionAction.CLOSE_ALL:
            for open_name in list(rank.open_sections):
                self._health.monitor.on_section_end(rank, open_name, now)
            return nvrx_wire.ok()
        if name is None:
            return nvrx_wire.error("a section name is required")
        if action is nvrx_wire.SectionAction.OPEN:
            if name in rank.open_sections:
                return nvrx_wire.error(f"Section '{name}' is already open.")
            self._health.monitor.on_section_start(rank, name, now)
        elif name not in rank.open_sections:
            return nvrx_wire.error(f"Section '{name}' is not open.")
        else:
            self._health.monitor.on_section_end(rank, name, now)
        return nvrx_wire.ok()

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

    def _config(self) -> nvrx_wire.Ref:
        """NVRx's FaultToleranceConfig as its client reads it: the timeouts in force."""
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
            },
        )

    def nvrx_disconnected(self, pid: int) -> None:
        """NVRx's monitor stops timing a rank whose connection closed."""
        rank = self._health.monitor.rank_of(pid)
        if rank is not None:
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
