"""A drop-in for `nvidia_resiliency_ext.fault_tolerance` as training scripts use it.

    import ftd_client.compat.nvrx as fault_tolerance   # instead of
    import nvidia_resiliency_ext.fault_tolerance as fault_tolerance

and a script written for ft_launcher runs under `ftd serve` unchanged otherwise. The mapping
onto ftd is documented in docs/nvrx-compat.md. Timeouts are computed by the daemon (which sees
every rank of the node) rather than by each client; the results read back the same way.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ftd_client import protocol
from ftd_client.rank import RankClient

log = logging.getLogger("ftd_client.compat.nvrx")

__all__ = [
    "HeartbeatTimeouts",
    "RankMonitorClient",
    "RankMonitorClientError",
    "SectionTimeouts",
    "WorkloadAction",
    "WorkloadControlRequest",
]

WARMUP_SECTION = "_warmup"
ITERATION_SECTION = "step"


class RankMonitorClientError(Exception):
    pass


class WorkloadAction(enum.Enum):
    Continue = protocol.WorkloadAction.CONTINUE
    ExcludeThisNode = protocol.WorkloadAction.EXCLUDE_THIS_NODE
    ShutdownWorkload = protocol.WorkloadAction.SHUTDOWN_WORKLOAD


@dataclass
class WorkloadControlRequest:
    action: WorkloadAction
    description: str = ""


@dataclass
class HeartbeatTimeouts:
    initial: float | None = None
    subsequent: float | None = None
    were_calculated: bool | None = None

    @property
    def are_valid(self) -> bool:
        return self.initial is not None and self.subsequent is not None


@dataclass
class SectionTimeouts:
    section: dict[str, float | None] = field(default_factory=dict)
    out_of_section: float | None = None
    calculated_sections: list[str] = field(default_factory=list)
    is_out_of_section_calculated: bool = False

    @property
    def are_valid(self) -> bool:
        return self.out_of_section is not None and all(
            value is not None for value in self.section.values()
        )


class RankMonitorClient:
    """NVIDIA's client interface over ftd's RankClient."""

    CURRENT_TIMEOUTS_STATE_KEY = "current_timeouts"

    def __init__(self) -> None:
        self.is_initialized = False
        self.hb_timeouts = HeartbeatTimeouts()
        self.section_timeouts = SectionTimeouts()
        self._client: RankClient | None = None
        self._loaded: dict[str, Any] | None = None
        self._warmup_left = 0
        self._calculated: set[str] = set()

    # -- lifecycle ---------------------------------------------------------------------------

    def init_workload_monitoring(self, num_warmup_iters: int = 0) -> None:
        """Connect to the daemon. The first `num_warmup_iters` iterations (closed "step"
        sections) are not timed: neither their step sections nor out-of-section time."""
        if self.is_initialized:
            raise RankMonitorClientError("RankMonitorClient is already initialized")
        self._client = RankClient()
        self.is_initialized = True
        self._warmup_left = num_warmup_iters
        if num_warmup_iters > 0:
            self._client.start_section(WARMUP_SECTION)
        if self._loaded:
            self._client.load_state_dict({"timeouts": self._loaded})
        else:
            self._client.wait_for_handshake()
        self._refresh()

    def shutdown_workload_monitoring(self) -> None:
        if self._client is not None:
            self._client.close()
        self._client = None
        self.is_initialized = False

    # -- heartbeats and sections -------------------------------------------------------------

    def send_heartbeat(self) -> None:
        self._ready().heartbeat()

    def start_section(self, section: str) -> None:
        if self._warmup_left > 0 and section == ITERATION_SECTION:
            return
        self._ready().start_section(section)

    def end_section(self, section: str) -> None:
        client = self._ready()
        if self._warmup_left > 0 and section == ITERATION_SECTION:
            self._warmup_left -= 1
            if self._warmup_left == 0:
                client.end_section(WARMUP_SECTION)
            return
        client.end_section(section)

    def end_all_sections(self) -> None:
        self._ready().end_all_sections()

    # -- timeouts ----------------------------------------------------------------------------

    def calculate_and_set_hb_timeouts(self, skip_if_not_ready: bool = False) -> bool:
        return self._calculate(["heartbeats"], False, skip_if_not_ready)

    def calculate_and_set_section_timeouts(
        self,
        selected_sections: list[str] | None = None,
        calc_out_of_section: bool = True,
        skip_if_not_ready: bool = False,
    ) -> bool:
        return self._calculate(selected_sections, calc_out_of_section, skip_if_not_ready)

    def calculate_and_set_timeouts(self, skip_if_not_ready: bool = False) -> bool:
        """The older, heartbeat-only name."""
        return self.calculate_and_set_hb_timeouts(skip_if_not_ready)

    def state_dict(self) -> Mapping[str, Any]:
        if not self.is_initialized:
            return {}
        state = self._ready().state_dict()
        return {self.CURRENT_TIMEOUTS_STATE_KEY: state["timeouts"]} if state["timeouts"] else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        timeouts = state.get(self.CURRENT_TIMEOUTS_STATE_KEY)
        if not isinstance(timeouts, dict):
            return
        # Also accepts NVIDIA's own HeartbeatTimeouts layout.
        if "subsequent" in timeouts:
            timeouts = {
                "initial_rank_heartbeat_timeout": timeouts.get("initial"),
                "rank_heartbeat_timeout": timeouts.get("subsequent"),
            }
        self._loaded = timeouts
        if self.is_initialized:
            self._ready().load_state_dict({"timeouts": timeouts})
            self._refresh()

    # -- workload control --------------------------------------------------------------------

    def send_workload_control_request(self, request: WorkloadControlRequest) -> None:
        client = self._ready()
        acknowledged = client.send_workload_control(request.action.value, request.description)
        if not acknowledged and client.is_supervised:
            raise RankMonitorClientError(f"the daemon did not acknowledge {request}")

    # -- internals ---------------------------------------------------------------------------

    def _ready(self) -> RankClient:
        if self._client is None:
            raise RankMonitorClientError("RankMonitorClient is not initialized")
        return self._client

    def _calculate(
        self, sections: list[str] | None, out_of_section: bool, skip_if_not_ready: bool
    ) -> bool:
        client = self._ready()
        if not client.is_supervised:
            return False
        learn_sections = [s for s in sections or [] if s != "heartbeats"] or None
        if sections == ["heartbeats"]:
            learn_sections = []
        learned = client.calculate_and_set_timeouts(learn_sections, out_of_section)
        if learned is None:
            if skip_if_not_ready:
                return False
            raise RankMonitorClientError("the daemon could not calculate timeouts")
        self._calculated |= set(sections or learned.get("rank_section_timeouts", {}))
        if out_of_section:
            self._calculated.add("__out_of_section__")
        self._refresh()
        return True

    def _refresh(self) -> None:
        timeouts = self._ready().state_dict()["timeouts"]
        self.hb_timeouts = HeartbeatTimeouts(
            timeouts.get("initial_rank_heartbeat_timeout"),
            timeouts.get("rank_heartbeat_timeout"),
            "heartbeats" in self._calculated,
        )
        sections = dict(timeouts.get("rank_section_timeouts") or {})
        sections.pop(WARMUP_SECTION, None)
        self.section_timeouts = SectionTimeouts(
            section=sections,
            out_of_section=timeouts.get("rank_out_of_section_timeout"),
            calculated_sections=sorted(self._calculated & set(sections)),
            is_out_of_section_calculated="__out_of_section__" in self._calculated,
        )

    def __repr__(self) -> str:
        return f"RankMonitorClient(hb={asdict(self.hb_timeouts)}, sections={self.section_timeouts})"
