"""Fault-tolerance parameters with ft_launcher's names, from YAML and `--ft-param-*`/`--ft-*`.

Each parameter's description is its `ftd serve` flag's help. `RankTimeouts` is the
live-tunable part (CLI, YAML, API PATCH, ranks' load_state_dict all validate through it);
`FaultToleranceConfig` adds what is fixed for the daemon's life. A timeout of None disables
that check.
"""

from __future__ import annotations

import difflib
import signal
from pathlib import Path
from typing import Annotated, Any

import yaml
from ftd_client.protocol import MAX_SECTION_NAME
from ftd_client.protocol import MAX_SECTIONS as MAX_PROTOCOL_SECTIONS
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ftd.text import is_decimal

MIN_TIMEOUT_S = 0.1
"""No hang timeout below this: a rank cannot be expected to answer faster, and a tiny value
(5e-324 through the API) would judge every rank hung at once."""
MAX_TIMEOUT_S = 30 * 24 * 3600.0
"""No hang timeout above 30 days: larger values are mistakes (or overflow a timer)."""
MAX_SECTIONS = MAX_PROTOCOL_SECTIONS

Seconds = Annotated[float, Field(ge=MIN_TIMEOUT_S, le=MAX_TIMEOUT_S, allow_inf_nan=False)]
"""Every hang timeout, from every source (CLI, YAML, API, a rank's load_state_dict, learning)."""


class RankTimeouts(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    initial_rank_heartbeat_timeout: Seconds | None = Field(
        None,
        description="seconds from a rank's start to its first heartbeat",
    )
    rank_heartbeat_timeout: Seconds | None = Field(
        None,
        description="seconds allowed between heartbeats",
    )
    rank_section_timeouts: dict[str, Seconds | None] = Field(
        default_factory=dict,
        max_length=MAX_SECTIONS,
        description="per-section seconds, e.g. setup:600,step:180,checkpointing:420",
    )
    rank_out_of_section_timeout: Seconds | None = Field(
        None,
        description="seconds allowed outside any section",
    )

    @field_validator("rank_section_timeouts", mode="before")
    @classmethod
    def _parse_sections(cls, value: object) -> object:
        if isinstance(value, str):
            return parse_section_timeouts(value)
        return value

    @field_validator("rank_section_timeouts")
    @classmethod
    def _section_names(cls, value: dict[str, float | None]) -> dict[str, float | None]:
        for name in value:
            if not name or len(name) > MAX_SECTION_NAME:
                raise ValueError(f"a section name must be 1 to {MAX_SECTION_NAME} characters")
        return value

    @field_validator(
        "initial_rank_heartbeat_timeout",
        "rank_heartbeat_timeout",
        "rank_out_of_section_timeout",
        mode="before",
    )
    @classmethod
    def _none_words(cls, value: object) -> object:
        return parse_optional_seconds(value) if isinstance(value, str) else value


class FaultToleranceConfig(RankTimeouts):
    safety_factor: float = Field(
        5.0,
        gt=0,
        le=1000,
        allow_inf_nan=False,
        description="a learned timeout is the longest observed interval times this (default 5)",
    )
    min_learned_timeout: Seconds = Field(
        1.0,
        description="seconds no learned timeout goes below (default 1)",
    )
    """A timeout learned from a fast, quiet run must not kill a rank on its first hiccup."""
    rank_termination_signal: str = Field(
        "SIGKILL",
        description="signal for a hung rank, after its stacks are dumped (default SIGKILL)",
    )
    log_level: str = Field(
        "INFO",
        description="log level of the rank-health components (default INFO)",
    )
    calc_timeouts: bool = Field(
        False,
        description="true: learn timeouts at the end of every attempt (default false)",
    )
    workload_check_interval: float = Field(
        5.0,
        gt=0,
        description="accepted for compatibility: ftd checks deadlines when due",
    )
    simulated_fault: str | None = Field(
        None,
        description=(
            "inject one fault in the first attempt: <kill|hang>:<rank|random>:<seconds or "
            "MIN-MAX>, e.g. hang:1:5"
        ),
    )
    max_no_progress_cycles: int = Field(
        3,
        ge=-1,
        le=1_000_000,
        description=(
            "attempts in a row whose checkpoint iteration did not grow before the job stops with "
            "--ft-no-restart-exit-code (default 3; 0 or -1: never)"
        ),
    )
    """Attempts in a row whose checkpoint iteration did not grow before the job stops
    (ftd/supervision/no_progress.py); 0 or -1: never."""
    min_progress_iterations: int = Field(
        1,
        ge=1,
        le=2**62,
        description="iterations an attempt must add to count as progress (default 1)",
    )
    checkpoint_iteration_file: str | None = Field(
        None,
        max_length=4096,
        description=(
            "a file holding the latest checkpoint's iteration (NVRx's); default: the steps saved "
            "through ftd_client.checkpoint"
        ),
    )
    gpu_memory_reclaim_timeout: float = Field(
        50.0,
        ge=0,
        le=3600,
        allow_inf_nan=False,
        description=(
            "between attempts, seconds to wait at most for every GPU's memory to be released, "
            "where NVML is present (default 50; 0: no wait)"
        ),
    )
    gpu_memory_tolerance_mb: float = Field(
        512.0,
        ge=0,
        le=2**30,
        allow_inf_nan=False,
        description="a GPU holding at most this many MiB counts as released (default 512)",
    )
    gpu_memory_poll_interval: float = Field(
        2.0,
        gt=0,
        le=60,
        allow_inf_nan=False,
        description="seconds between looks at the GPUs' memory (default 2)",
    )
    no_restart_exit_code: int = Field(
        93,
        ge=1,
        le=255,
        description="every node's exit code when restarting cannot help (default 93)",
    )
    node_health_check: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description=(
            "a command run before every rendezvous: exit 0 is healthy, else the node sits out "
            "(its last output line the reason) and looks again (default: none)"
        ),
    )
    node_health_check_timeout: float = Field(
        60.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="seconds the health check may take (default 60)",
    )
    node_health_check_interval: float = Field(
        5.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="seconds between an unhealthy node's looks (default 5)",
    )
    node_health_check_failures: int = Field(
        3,
        ge=0,
        le=1_000_000,
        description=(
            "looks in a row that find the node unhealthy before it excludes itself, until `ftd "
            "readmit` (default 3; 0: never)"
        ),
    )
    node_health_check_endpoint: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description=(
            "the unix socket of NVIDIA's node health check service (nvhcd; /path or "
            "unix:///path), asked before every rendezvous: fail_count 0 is healthy; a socket that"
            " does not exist skips the check (default: none)"
        ),
    )
    storage_healthcheck_path: str | None = Field(
        None,
        max_length=65536,
        description=(
            "comma-separated paths that must be reachable directories before every rendezvous "
            "(default: none)"
        ),
    )
    link_state_path_template: str | None = Field(
        None,
        max_length=4096,
        description=(
            "NIC port state files, {nic} for the device, e.g. "
            "/sys/class/infiniband/{nic}/ports/1/state: a port that was ACTIVE must stay so"
        ),
    )

    @field_validator("simulated_fault")
    @classmethod
    def _fault(cls, value: str | None) -> str | None:
        if value is not None:
            parse_simulated_fault(value)
        return value

    @field_validator("rank_termination_signal")
    @classmethod
    def _signal(cls, value: str) -> str:
        name = value.strip().upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        if name not in signal.Signals.__members__:
            raise ValueError(f"unknown signal {value!r}")
        return name

    def timeouts(self) -> RankTimeouts:
        return RankTimeouts.model_validate(
            {name: getattr(self, name) for name in RankTimeouts.model_fields}
        )


# ft_launcher parameters that have no meaning for ftd (GPU/NIC/storage checks, attribution,
# its own restart protocol): accepted so existing configs work, and ignored with a log line.
IGNORED_PARAMETERS = frozenset(
    {
        "restart_check_interval",
        "enable_nic_monitor",
        "enable_nic_healthcheck",
        "enable_dist_storage_healthcheck",
        "pci_topo_file",
        "link_down_path_template",
        "skip_section_response",
        "segment",
        "numa_bind_strict",
        "check_remaining_processes",
        "install_exception_hook",
        "num_warmup_iterations",
        "attribution_endpoint",
        "attribution_stop_action",
        "attribution_export_url",
        "cycle_info_dir",
        "segment_health_check_dir",
    }
)
# Handled by other flags of `ftd serve`.
DELEGATED_PARAMETERS = {"restart_policy": "restart_policy", "state_file": "ft_state_file"}

KNOWN_PARAMETERS = (
    frozenset(FaultToleranceConfig.model_fields) | IGNORED_PARAMETERS | set(DELEGATED_PARAMETERS)
)


class UnknownParameter(ValueError):
    pass


def check_parameter_name(name: str) -> str:
    """The parameter's canonical name (kebab-case accepted); UnknownParameter naming the
    closest valid one otherwise."""
    canonical = name.replace("-", "_")
    if canonical in KNOWN_PARAMETERS:
        return canonical
    close = difflib.get_close_matches(canonical, sorted(KNOWN_PARAMETERS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise UnknownParameter(f"unknown fault-tolerance parameter {name!r}{hint}")


def parse_simulated_fault(value: str) -> tuple[str, int | None, float, float]:
    """`hang:1:5` or `kill:random:2-8` -> (kind, rank or None for random, min delay, max delay)."""
    parts = value.split(":")
    if len(parts) != 3:
        raise ValueError(f"expected <kill|hang>:<rank|random>:<delay>, got {value!r}")
    kind, target, delay = (part.strip() for part in parts)
    if kind not in ("kill", "hang"):
        raise ValueError(f"fault kind must be kill or hang, got {kind!r}")
    if target != "random" and not is_decimal(target):
        raise ValueError(f"fault target must be a rank or 'random', got {target!r}")
    low, _, high = delay.partition("-")
    try:
        low_s, high_s = float(low), float(high or low)
    except ValueError:
        raise ValueError(f"fault delay must be seconds or MIN-MAX, got {delay!r}") from None
    if not 0 <= low_s <= high_s:
        raise ValueError(f"fault delay range {delay!r} is empty or negative")
    return kind, None if target == "random" else int(target), low_s, high_s


def parse_optional_seconds(value: str) -> float | None:
    value = value.strip()
    if value.lower() in ("none", "null", ""):
        return None
    return float(value)


def parse_section_timeouts(value: str) -> dict[str, float | None]:
    """`setup:600,step:180,checkpointing:None`."""
    sections: dict[str, float | None] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, sep, timeout = item.partition(":")
        if not sep:
            raise ValueError(f"expected name:seconds, got {item!r}")
        sections[name.strip()] = parse_optional_seconds(timeout)
    return sections


def load_yaml(path: Path) -> dict[str, Any]:
    """The `fault_tolerance` section of a YAML file (top level or nested anywhere), or the
    whole mapping when it has no such section."""
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping")
    section = _find_section(data)
    return section if section is not None else data


def _find_section(data: dict[str, Any]) -> dict[str, Any] | None:
    found = data.get("fault_tolerance")
    if isinstance(found, dict):
        return found
    for value in data.values():
        if isinstance(value, dict) and (nested := _find_section(value)) is not None:
            return nested
    return None


def merge_parameters(
    from_file: dict[str, Any], from_cli: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(FaultToleranceConfig fields, delegated values, ignored names); CLI overrides the file."""
    fields: dict[str, Any] = {}
    delegated: dict[str, Any] = {}
    ignored: list[str] = []
    for source in (from_file, from_cli):
        for raw_name, value in source.items():
            name = check_parameter_name(raw_name)
            if name in IGNORED_PARAMETERS:
                ignored.append(name)
            elif name in DELEGATED_PARAMETERS:
                delegated[DELEGATED_PARAMETERS[name]] = value
            else:
                fields[name] = value
    return fields, delegated, ignored
