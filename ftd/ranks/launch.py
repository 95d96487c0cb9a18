"""What a rank is started with: its command line and its torchrun-compatible environment.

The FTD_* variables are ftd's contract with ranks; docs/environment.md lists them.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from ftd.config.serve import ServeConfig
from ftd.coordination.base import Placement

STACK_SIGNAL = signal.SIGUSR2
"""Ranks' ftd_client dumps its Python stacks (faulthandler) on this signal."""


def build_command(config: ServeConfig) -> tuple[str, ...]:
    """torchrun's argv: `python -u [-m] script`, or the binary itself with --no-python."""
    if config.no_python:
        return (config.entrypoint, *config.script_args)
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    module = ("-m",) if config.module else ()
    return (python, "-u", *module, config.entrypoint, *config.script_args)


def worker_envs(
    config: ServeConfig,
    placement: Placement,
    restart_count: int,
    run_dir: str,
    daemon_id: str,
    socket_path: str = "",
    attempt_log_dir: str = "",
    send_buffer: int = 0,
    nvrx_sockets: bool = True,
) -> dict[int, dict[str, str]]:
    """Each local rank's environment, as torchrun's LocalElasticAgent sets it, plus FTD_*
    (NVRx's socket paths only with `nvrx_sockets`: when the daemon serves them)."""
    envs: dict[int, dict[str, str]] = {}
    for local_rank in range(config.nproc_per_node):
        global_rank = placement.base_global_rank + local_rank
        env = {
            "LOCAL_RANK": str(local_rank),
            "RANK": str(global_rank),
            "GROUP_RANK": str(placement.group_rank),
            "ROLE_RANK": str(global_rank),
            "ROLE_NAME": config.role,
            "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
            "WORLD_SIZE": str(placement.world_size),
            "GROUP_WORLD_SIZE": str(placement.group_world_size),
            "ROLE_WORLD_SIZE": str(placement.world_size),
            "MASTER_ADDR": placement.master_addr,
            "MASTER_PORT": str(placement.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
            "TORCHELASTIC_RUN_ID": config.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": str(True),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get(
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"
            ),
            # torchrun exports its --signals-to-handle to the ranks; ftd handles the same ones.
            "TORCHELASTIC_SIGNALS_TO_HANDLE": os.environ.get(
                "TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
            ),
            "FTD_RUN_DIR": run_dir,
            "FTD_NODE_ID": config.node_id,
            "FTD_DAEMON_ID": daemon_id,
        }
        if config.enable_fault_injection:
            env["FTD_FAULT_INJECTION"] = "1"
        if socket_path:
            env["FTD_SOCKET"] = socket_path
            env["FTD_PROGRESS"] = "1" if config.progress else "0"
            env["FTD_STACK_SIGNAL"] = str(int(STACK_SIGNAL))
            if send_buffer > 0:
                env["FTD_SOCKET_SNDBUF"] = str(send_buffer)
            if nvrx_sockets:  # for nvidia_resiliency_ext's own client
                env.update(nvrx_rank_env(socket_path))
        if attempt_log_dir:
            env["FTD_STACKS_FILE"] = os.path.join(attempt_log_dir, str(local_rank), "stacks.txt")
        omp = os.environ.get("OMP_NUM_THREADS")
        if omp is None and config.nproc_per_node > 1:
            omp = "1"  # torchrun's default, so ranks do not oversubscribe the cores
        if omp is not None:
            env["OMP_NUM_THREADS"] = omp
        envs[local_rank] = env
    return envs


# NVRx's sockets (served by ftd.health.nvrx.server), named beside ftd's own socket.
RANK_MONITOR_ENV = "FT_RANK_MONITOR_IPC_SOCKET"
LAUNCHER_ENV = "FT_LAUNCHER_IPC_SOCKET"


def socket_paths(ftd_socket: Path) -> tuple[Path, Path]:
    """The rank-monitor and launcher socket paths beside ftd's own socket, in its directory: the
    private run directory, or the private one ftd.health.unix_socket.socket_path made where
    that is too long (never a shared one, where another user could bind the name first)."""
    stem = ftd_socket.name.removesuffix(".sock")
    rank_monitor, launcher = (
        ftd_socket.with_name(f"{stem}-nvrx-{kind}.sock") for kind in ("rmon", "launcher")
    )
    return rank_monitor, launcher


def nvrx_rank_env(ftd_socket: str) -> dict[str, str]:
    """What NVRx's rank client reads from the environment."""
    rank_monitor, launcher = socket_paths(Path(ftd_socket))
    return {RANK_MONITOR_ENV: str(rank_monitor), LAUNCHER_ENV: str(launcher)}
