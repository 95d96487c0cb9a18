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
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

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
    calculated_sections: set[str] = field(default_factory=set)
    is_out_of_section_calculated: bool = False

    def __post_init__(self) -> None:
        self.calculated_sections = set(self.calculated_sections)

    @property
    def were_calculated(self) -> bool:
        return self.calculated_sections == set(self.section) and self.is_out_of_section_calculated

    @property
    def are_valid(self) -> bool:
        return self.out_of_section is not None and all(
            value is not None for value in self.section.values()
        )


HB_NAMES = ("initial_rank_heartbeat_timeout", "rank_heartbeat_timeout")
OOS_NAME = "rank_out_of_section_timeout"


class RankMonitorClient:
    """NVIDIA's client interface over ftd's RankClient; timeouts are learned by NVRx's rule
    (see ftd/health/learning.py), from what the daemon observed on every rank of the node."""

    CURRENT_TIMEOUTS_STATE_KEY = "current_timeouts"

    def __init__(self) -> None:
        self.is_initialized = False
        self.hb_timeouts = HeartbeatTimeouts()
        self.section_timeouts = SectionTimeouts()
        self.loaded_hb_timeouts: HeartbeatTimeouts | None = None
        self.loaded_section_timeouts: SectionTimeouts | None = None
        self._client: RankClient | None = None
        self._warmup_left = 0

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
        self._client.wait_for_handshake()
        self._refresh()
        if self.loaded_hb_timeouts is not None or self.loaded_section_timeouts is not None:
            self._send_loaded()

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
        """NVRx's rule: safety_factor times the longest wait for the first heartbeat and the
        longest interval, merged 50/50 with values that were themselves calculated."""
        return self._calculate("hb", None, False, skip_if_not_ready)

    def calculate_and_set_section_timeouts(
        self,
        selected_sections: Collection[str] | None = None,
        calc_out_of_section: bool = True,
        skip_if_not_ready: bool = False,
    ) -> bool:
        """NVRx's rule: `selected_sections` None relearns every configured section, a list
        those only (`[]`: none); the out-of-section timeout when `calc_out_of_section`."""
        sections = None if selected_sections is None else list(selected_sections)
        return self._calculate("sections", sections, calc_out_of_section, skip_if_not_ready)

    def calculate_and_set_timeouts(self, skip_if_not_ready: bool = False) -> bool:
        """The older, heartbeat-only name."""
        return self.calculate_and_set_hb_timeouts(skip_if_not_ready)

    def state_dict(self) -> Mapping[str, Any]:
        """NVRx's layout: only calculated timeouts are saved, the same on every rank."""
        timeouts: dict[str, Any] = {}
        if self.hb_timeouts.are_valid and self.hb_timeouts.were_calculated:
            timeouts["heartbeat"] = asdict(self.hb_timeouts)
        sections = self.section_timeouts
        if sections.calculated_sections or sections.is_out_of_section_calculated:
            saved = asdict(sections)
            saved["calculated_sections"] = sorted(sections.calculated_sections)
            timeouts["section"] = saved
        return {self.CURRENT_TIMEOUTS_STATE_KEY: timeouts}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """NVRx's layout (`current_timeouts` with `heartbeat` and `section`); may be called
        before or after `init_workload_monitoring`."""
        saved = state.get(self.CURRENT_TIMEOUTS_STATE_KEY)
        if not isinstance(saved, Mapping):
            return
        try:
            if isinstance(saved.get("heartbeat"), Mapping):
                self.loaded_hb_timeouts = HeartbeatTimeouts(**saved["heartbeat"])
            if isinstance(saved.get("section"), Mapping):
                self.loaded_section_timeouts = SectionTimeouts(**saved["section"])
        except TypeError as error:
            raise RankMonitorClientError(f"not a RankMonitorClient state: {error}") from None
        if self.is_initialized:
            self._send_loaded()

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
        self,
        kind: Literal["hb", "sections"],
        sections: list[str] | None,
        out_of_section: bool,
        skip_if_not_ready: bool,
    ) -> bool:
        client = self._ready()
        if not client.is_supervised:
            return False
        learned = client.calculate_and_set_timeouts(
            sections, out_of_section, rule="nvrx", kind=kind
        )
        if learned is None:
            if skip_if_not_ready and client.last_error.startswith("not ready"):
                return False
            raise RankMonitorClientError(
                f"Not enough data to compute timeouts ({client.last_error or 'no answer'})."
            )
        self._refresh()
        return True

    def _send_loaded(self) -> None:
        """Loaded timeouts to the daemon: calculated values stay learned ones there."""
        patch: dict[str, Any] = {}
        learned: list[str] = []
        if (hb := self.loaded_hb_timeouts) is not None:
            patch.update(zip(HB_NAMES, (hb.initial, hb.subsequent), strict=True))
            learned += list(HB_NAMES) if hb.were_calculated else []
        if (sections := self.loaded_section_timeouts) is not None:
            patch["rank_section_timeouts"] = dict(sections.section)
            patch[OOS_NAME] = sections.out_of_section
            learned += [f"section:{name}" for name in sorted(sections.calculated_sections)]
            learned += [OOS_NAME] if sections.is_out_of_section_calculated else []
        client = self._ready()
        client.load_state_dict({"timeouts": patch, "learned": learned})
        if client.is_supervised and client.last_error:
            raise RankMonitorClientError(f"the daemon refused the timeouts: {client.last_error}")
        self._refresh()

    def _refresh(self) -> None:
        client = self._ready()
        timeouts, learned = client.timeouts, client.learned
        self.hb_timeouts = HeartbeatTimeouts(
            timeouts.get(HB_NAMES[0]),
            timeouts.get(HB_NAMES[1]),
            all(name in learned for name in HB_NAMES),
        )
        sections = dict(timeouts.get("rank_section_timeouts") or {})
        sections.pop(WARMUP_SECTION, None)
        self.section_timeouts = SectionTimeouts(
            section=sections,
            out_of_section=timeouts.get(OOS_NAME),
            calculated_sections={name for name in sections if f"section:{name}" in learned},
            is_out_of_section_calculated=OOS_NAME in learned,
        )

    def __repr__(self) -> str:
        return f"RankMonitorClient(hb={asdict(self.hb_timeouts)}, sections={self.section_timeouts})"
