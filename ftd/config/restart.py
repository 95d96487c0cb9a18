"""What a restart replaces and whose failure restarts whom: `--restart-mode` and
`--restart-policy`. Without pydantic, so that the command line's help can name them and `ftd
status` stays light."""

from __future__ import annotations

from enum import StrEnum


class RestartPolicy(StrEnum):
    """--restart-policy: whose failure restarts whom (ft_launcher's names). Its decisions are
    supervision/policy.py's; the flag's choices and help come from here."""

    ANY_FAILED = "any-failed"
    MIN_HEALTHY = "min-healthy"

    @property
    def help(self) -> str:
        return _RESTART_POLICY_HELP[self]


_RESTART_POLICY_HELP = {
    RestartPolicy.ANY_FAILED: "any failure restarts every node's workers",
    RestartPolicy.MIN_HEALTHY: "a lost node restarts the others only below MIN healthy nodes",
}


class RestartMode(StrEnum):
    """--restart-mode: what a restart replaces."""

    PROCESS = "process"
    """Every rank's process (torchrun's way)."""
    INPROCESS = "inprocess"
    """Only the failed rank's process; the others re-run their function in place."""
