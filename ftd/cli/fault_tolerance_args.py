"""`ftd serve`'s fault-tolerance arguments: ft_launcher's parameters, in each of the spellings
ft_launcher accepts, and the restart policy and state file. Standard library only (the CLI's
`--help` must not import pydantic or torch; the parameter names are read when the parser is
built)."""

from __future__ import annotations

import argparse

from ftd.config.restart import RestartPolicy

FT_HELP = {
    "initial_rank_heartbeat_timeout": "seconds from a rank's start to its first heartbeat",
    "rank_heartbeat_timeout": "seconds allowed between heartbeats",
    "rank_section_timeouts": "per-section seconds, e.g. setup:600,step:180,checkpointing:420",
    "rank_out_of_section_timeout": "seconds allowed outside any section",
    "safety_factor": "a learned timeout is the longest observed interval times this (default 5)",
    "min_learned_timeout": "seconds no learned timeout goes below (default 1)",
    "rank_termination_signal": "signal for a hung rank, after its stacks are dumped "
    "(default SIGKILL)",
    "log_level": "log level of the rank-health components (default INFO)",
    "calc_timeouts": "true: learn timeouts at the end of every attempt (default false)",
    "workload_check_interval": "accepted for compatibility: ftd checks deadlines when due",
    "simulated_fault": "inject one fault in the first attempt: <kill|hang>:<rank|random>:"
    "<seconds or MIN-MAX>, e.g. hang:1:5",
    "max_no_progress_cycles": "attempts in a row whose checkpoint iteration did not grow before "
    "the job stops with --ft-no-restart-exit-code (default 3; 0 or -1: never)",
    "min_progress_iterations": "iterations an attempt must add to count as progress (default 1)",
    "checkpoint_iteration_file": "a file holding the latest checkpoint's iteration (NVRx's); "
    "default: the steps saved through ftd_client.checkpoint",
    "no_restart_exit_code": "every node's exit code when restarting cannot help (default 93)",
    "gpu_memory_reclaim_timeout": "between attempts, seconds to wait at most for every GPU's "
    "memory to be released, where NVML is present (default 50; 0: no wait)",
    "gpu_memory_tolerance_mb": "a GPU holding at most this many MiB counts as released "
    "(default 512)",
    "gpu_memory_poll_interval": "seconds between looks at the GPUs' memory (default 2)",
    "node_health_check": "a command run before every rendezvous: exit 0 is healthy, else the "
    "node sits out (its last output line the reason) and looks again (default: none)",
    "node_health_check_timeout": "seconds the health check may take (default 60)",
    "node_health_check_interval": "seconds between an unhealthy node's looks (default 5)",
    "node_health_check_failures": "looks in a row that find the node unhealthy before it "
    "excludes itself, until `ftd readmit` (default 3; 0: never)",
    "storage_healthcheck_path": "comma-separated paths that must be reachable directories "
    "before every rendezvous (default: none)",
    "link_state_path_template": "NIC port state files, {nic} for the device, e.g. "
    "/sys/class/infiniband/{nic}/ports/1/state: a port that was ACTIVE must stay so",
    "node_health_check_endpoint": "the unix socket of NVIDIA's node health check service "
    "(nvhcd; /path or unix:///path), asked before every rendezvous: fail_count 0 is healthy; "
    "a socket that does not exist skips the check (default: none)",
}
FT_ALIASES = {"node_health_check": ("--node-health-check", "--node_health_check")}
"""ftd's own names for an ft parameter, beside --ft-param-NAME and --ft-NAME."""
FT_METAVAR = {
    "rank_section_timeouts": "NAME:S,...",
    "rank_termination_signal": "SIGNAL",
    "log_level": "LEVEL",
    "calc_timeouts": "BOOL",
    "simulated_fault": "SPEC",
    "safety_factor": "X",
    "max_no_progress_cycles": "N",
    "min_progress_iterations": "N",
    "checkpoint_iteration_file": "FILE",
    "no_restart_exit_code": "CODE",
    "gpu_memory_reclaim_timeout": "SECONDS",
    "gpu_memory_tolerance_mb": "MIB",
    "gpu_memory_poll_interval": "SECONDS",
    "node_health_check": "CMD",
    "node_health_check_failures": "N",
    "storage_healthcheck_path": "PATHS",
    "link_state_path_template": "TEMPLATE",
    "node_health_check_endpoint": "PATH",
}


def add_fault_tolerance(serve: argparse.ArgumentParser) -> None:
    from ftd.config.ft import DELEGATED_PARAMETERS, IGNORED_PARAMETERS, KNOWN_PARAMETERS

    group = serve.add_argument_group(
        "fault tolerance (ft_launcher's parameters)",
        "Each parameter NAME is accepted as --ft-param-NAME=VALUE (ft_launcher's seed form) "
        "and as --ft-NAME VALUE (current ft_launcher; kebab or snake case), or from the YAML "
        "file's fault_tolerance section; the command line overrides the file. 'None' disables "
        "a timeout; every timeout is off by default. Accepted and ignored (they mean nothing "
        "to ftd): " + ", ".join(sorted(IGNORED_PARAMETERS)) + ".",
    )
    add = group.add_argument
    add(
        "--ft-cfg-path",
        "--ft_cfg_path",
        "--fault-tol-cfg-path",
        "--fault_tol_cfg_path",
        dest="ft_cfg_path",
        default=None,
        metavar="FILE",
        help="YAML file with a fault_tolerance section",
    )
    add(
        "--restart-policy",
        "--restart_policy",
        "--ft-restart-policy",
        "--ft_restart_policy",
        "--ft-param-restart_policy",
        dest="restart_policy",
        choices=[policy.value for policy in RestartPolicy],
        default=None,
        help="; ".join(f"{policy}: {policy.help}" for policy in RestartPolicy)
        + f" (default: {RestartPolicy.ANY_FAILED})",
    )
    add(
        "--ft-state-file",
        "--ft_state_file",
        "--ft-param-state_file",
        dest="ft_state_file",
        default=None,
        metavar="FILE",
        help="learned timeouts persist here (default: <run dir>/ft_state.json)",
    )
    for name in sorted(KNOWN_PARAMETERS - set(DELEGATED_PARAMETERS)):
        kebab = name.replace("_", "-")
        spellings = {f"--ft-param-{name}", f"--ft-param-{kebab}", f"--ft-{kebab}", f"--ft-{name}"}
        spellings |= set(FT_ALIASES.get(name, ()))
        add(
            f"--ft-param-{name}",
            *sorted(spellings - {f"--ft-param-{name}"}),
            dest=f"ft__{name}",
            default=None,
            metavar=FT_METAVAR.get(name, "SECONDS"),
            help=FT_HELP.get(name, argparse.SUPPRESS),
        )
