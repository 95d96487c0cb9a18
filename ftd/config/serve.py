"""The one frozen, typed configuration of `ftd serve`; the CLI is a thin layer over it."""

from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ftd.config.ft import FaultToleranceConfig
from ftd.config.restart import RestartMode, RestartPolicy
from ftd.text import is_decimal

RDZV_LIST_MAX = 64
"""`--rdzv-conf list_max`'s default (coordination/assignment.py's LIST_MAX)."""

NO_PRELOAD = "none"
"""`--preload none`: the zygote imports nothing, not even torch (for ranks that do not use it)."""

DEFAULT_API_PORT = 29610

StartMethod = Literal["spawn", "fork", "forkserver", "subprocess", "zygote"]
WorkersStoreProcess = Literal["auto", "on", "off"]


STD_VALUES = {"0": 0, "1": 1, "2": 2, "3": 3}


def parse_std(value: str) -> int | dict[int, int]:
    """torchrun's `--redirects/--tee` value: `N` for every rank or `rank:N,rank:N`; N in 0..3."""
    if value in STD_VALUES:
        return STD_VALUES[value]
    mapping: dict[int, int] = {}
    for item in value.split(","):
        rank, sep, std = item.partition(":")
        if not sep or not is_decimal(rank.strip()) or std.strip() not in STD_VALUES:
            raise ValueError(f"expected 0-3 or local_rank:0-3[,...], got {value!r}")
        mapping[int(rank)] = STD_VALUES[std.strip()]
    return mapping


class ServeConfig(BaseModel):
    """Everything one node daemon needs; durations carry their unit in the name."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    entrypoint: str = Field(
        min_length=1, description="training script, module (with module=True) or binary"
    )
    script_args: tuple[str, ...] = ()
    module: bool = False
    no_python: bool = False

    nnodes_min: int = Field(1, ge=1)
    nnodes_max: int = Field(1, ge=1)
    hot_spares: int = Field(0, ge=0)
    """--hot-spares: how many nodes beyond the round's size `--nnodes MIN:MAX` allows for
    (MAX - MIN); they wait as standbys, the round's size is MIN (NVRx's ft_launcher reading)."""
    nproc_per_node: int = Field(1, ge=1)
    max_restarts: int = Field(0, ge=0)
    standalone: bool = False
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = ""
    run_id: str = "none"
    rdzv_conf: dict[str, str] = Field(default_factory=dict)
    master_addr: str | None = None
    master_port: int | None = Field(None, ge=0, le=65535)
    local_addr: str | None = None
    """The address other nodes reach this node at (its workers' store, when it hosts it)."""
    workers_store_process: WorkersStoreProcess = Field(
        "auto",
        description="on: the workers' store runs in a process of its own, so the burst of a "
        "whole job's init never stalls the daemon's loop (its hang verdicts); off: on the "
        "daemon's loop; auto: in its own process when nnodes MAX x nproc-per-node reaches "
        "ftd.ranks.workers_store.OWN_PROCESS_FROM_RANKS",
    )
    node_rank: int | None = Field(None, ge=0, lt=2**20)
    """The scheduler's rank of this node (--node-rank, SLURM_NODEID, a pod's index): nodes
    that have one are ranked in its order, so a node that replaces another under the same
    scheduler rank takes its place and the others keep theirs."""
    node_keepalive_timeout_s: float = Field(5.0, gt=0)
    """A node whose keepalive is older than this is declared dead by the survivors."""
    rdzv_last_call_timeout_s: float = Field(30.0, ge=0)
    """Once MIN nodes joined, a round waits this long for more before it closes."""
    rdzv_join_timeout_s: float = Field(600.0, gt=0)
    """How long a round waits for MIN nodes before the job fails."""
    rdzv_list_max: int = Field(RDZV_LIST_MAX, ge=0, le=100_000)
    """Rounds of at most this many nodes are listed on every node; in a larger one each node
    reads only its own assignment (`--rdzv-conf list_max=N`, coordination/assignment.py)."""
    role: str = "default"
    start_method: StartMethod = "zygote"
    preload: tuple[str, ...] = Field(
        (),
        description="modules the zygote imports besides torch (start_method zygote); "
        "('none',): not even torch",
    )
    node_id: str = Field(default_factory=socket.gethostname, min_length=1)

    log_dir: Path | None = None
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: frozenset[int] | None = None

    ft: FaultToleranceConfig = Field(default_factory=lambda: FaultToleranceConfig())
    ft_state_file: Path | None = None
    """Learned timeouts survive restarts here; default `<run dir>/ft_state.json`."""
    restart_policy: RestartPolicy = RestartPolicy.ANY_FAILED
    restart_mode: RestartMode = RestartMode.PROCESS
    """`inprocess`: a fault is announced to every rank, whose ftd_client.inprocess.Wrapper
    restarts the training function in the same process (docs/inprocess.md); `process`: every
    rank is stopped and started again."""
    restart_backoff_base_s: float = Field(1.0, ge=0, le=3600)
    """After the second attempt in a row that failed fast, wait this long before the next,
    doubling each time (kubelet's CrashLoopBackOff); 0 turns the back-off off."""
    restart_backoff_cap_s: float = Field(60.0, ge=0, le=86400)
    restart_backoff_reset_s: float = Field(300.0, gt=0, le=86400 * 30)
    """An attempt that ran this long ended no crash loop: the back-off starts over."""
    inprocess_respawn: bool = True
    """In-process mode: a rank whose process died is started again and joins the next round
    (counted against max_restarts); False: the others go on without it."""

    progress: bool = True
    """Ranks report their progress (ftd_client/progress.py) and are judged by it."""
    progress_timeout_floor_s: float = Field(300.0, gt=0, le=86400 * 30)
    """The learned progress deadline is never shorter (ftd/health/progress.py)."""
    checkpoint_memory_bytes: int | None = Field(None, ge=0, le=2**48)
    """Memory held for ftd_client.checkpoint's snapshots; None: half of /dev/shm's free space."""
    checkpoint_persist_dir: Path | None = None
    """Every `checkpoint_persist_every`-th snapshot is also written there by its rank (DCP)."""
    checkpoint_persist_every: int = Field(100, ge=1, le=2**53)
    checkpoint_every: int | None = Field(1, ge=1, le=2**20)
    """A snapshot at the steps divisible by it; None: auto, Young/Daly's interval as a power of
    two (client/ftd_client/checkpoint/_spacing.py)."""
    enable_fault_injection: bool = False
    """Allow `POST /v1/faults`; ranks then accept the fault signals (see ftd_client.faults)."""

    api_host: str = "127.0.0.1"
    api_port: int | None = Field(
        DEFAULT_API_PORT, ge=0, le=65535, description="0 picks a free port; None disables the API"
    )
    api_port_explicit: bool = False
    """Whether --api-port was given: then a taken port is an error, not a reason to move."""
    api_token_file: Path | None = None
    """Bearer token file; default `<run dir>/api.token`, created 0600 when absent."""

    shutdown_timeout_s: float = Field(
        5.0, ge=0, description="grace between the termination signal and SIGKILL"
    )
    termination_signal: str = "SIGTERM"

    @field_validator("termination_signal")
    @classmethod
    def _known_signal(cls, value: str) -> str:
        import signal

        name = value if value.startswith("SIG") else f"SIG{value}"
        if name not in signal.Signals.__members__:
            raise ValueError(f"unknown signal {value!r}")
        return name

    @field_validator("preload")
    @classmethod
    def _module_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if not all(part.isidentifier() for part in name.split(".")):
                raise ValueError(f"{name!r} is not a module name")
        if NO_PRELOAD in value and len(value) > 1:
            raise ValueError(f"{NO_PRELOAD!r} preloads nothing: it names no other module")
        return value

    @field_validator("redirects", "tee")
    @classmethod
    def _std_spec(cls, value: str) -> str:
        parse_std(value)
        return value

    @model_validator(mode="after")
    def _coherent(self) -> ServeConfig:
        if self.nnodes_min > self.nnodes_max:
            raise ValueError(f"nnodes: MIN {self.nnodes_min} is above MAX {self.nnodes_max}")
        if self.preload and self.start_method != "zygote":
            raise ValueError("preload: only --start-method zygote preloads modules")
        if self.module and self.no_python:
            raise ValueError("module: --module and --no-python cannot be used together")
        if self.no_python:
            if shutil.which(self.entrypoint) is None:
                raise ValueError(
                    f"entrypoint: {self.entrypoint!r} is not an executable file or on PATH"
                )
        elif not self.module and not Path(self.entrypoint).is_file():
            raise ValueError(f"entrypoint: training script {self.entrypoint!r} does not exist")
        if self.log_dir is not None:
            _check_writable_dir(self.log_dir)
        return self

    @property
    def multi_node(self) -> bool:
        """Whether the daemons meet in a rendezvous store (else: today's single-node path)."""
        return not self.standalone and (self.nnodes_max > 1 or self.hot_spares > 0)


def _check_writable_dir(path: Path) -> None:
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"log_dir: {str(probe)!r} is not a directory")
    try:  # os.access says yes to root everywhere, /proc included: try it for real
        tempfile.TemporaryDirectory(dir=probe, prefix=".ftd-probe-").cleanup()
    except OSError:
        raise ValueError(f"log_dir: {str(probe)!r} is not writable") from None


def parse_nnodes(value: str) -> tuple[int, int]:
    """torchrun's `--nnodes`: `N` or `MIN:MAX`."""
    parts = value.split(":")
    try:
        if len(parts) == 1:
            n = int(parts[0])
            return n, n
        if len(parts) == 2:
            return int(parts[0]), int(parts[1])
    except ValueError:
        pass
    raise ValueError(f"nnodes: expected N or MIN:MAX, got {value!r}")


def parse_rdzv_conf(value: str) -> dict[str, str]:
    """torchrun's `--rdzv-conf key1=v1,key2=v2`."""
    conf: dict[str, str] = {}
    for item in filter(None, value.split(",")):
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise ValueError(f"rdzv_conf: expected key=value, got {item!r}")
        conf[key.strip()] = val.strip()
    return conf
