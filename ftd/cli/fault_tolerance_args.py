"""`ftd serve`'s fault-tolerance arguments: ft_launcher's parameters, in each of the spellings
ft_launcher accepts, and the restart policy and state file. The parameters, their names and
their help are FaultToleranceConfig's (ftd.config.ft), read when the parser is built."""

from __future__ import annotations

import argparse

from ftd.config.restart import RestartPolicy

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
    from ftd.config.ft import (
        DELEGATED_PARAMETERS,
        IGNORED_PARAMETERS,
        KNOWN_PARAMETERS,
        FaultToleranceConfig,
    )

    described = FaultToleranceConfig.model_fields

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
            help=described[name].description if name in described else argparse.SUPPRESS,
        )
