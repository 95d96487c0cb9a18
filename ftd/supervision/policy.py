"""Restart decisions: pure functions of the state, returning an action and a reason."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ftd.config.restart import RestartPolicy
from ftd.status.model import Failure


class Action(enum.StrEnum):
    SUCCEED = "succeed"
    RESTART = "restart"
    FAIL = "fail"
    CONTINUE = "continue"


NO_RESTARTS_LEFT = "no restarts left"
NOT_RESTARTED = "not restarted: "
CANNOT_HELP = "restarting cannot help: "
"""What a fail decision's reason says when attempts in a row made no progress (no_progress.py)."""
"""What a fail decision's reason says when a rank asked for the job's end (its request
follows), as against running out of restarts: the job's last line names which."""


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    exit_code: int = 1
    """A FAIL's exit code on every node."""


@dataclass(frozen=True)
class Stuck:
    """Restarting cannot help (no_progress.py): why, and every node's exit code."""

    reason: str
    exit_code: int


def after_attempt(
    outcome: Failure | None,
    restarts_used: int,
    max_restarts: int,
    workload_stop: str | None = None,
    stuck: Stuck | None = None,
) -> Decision:
    """What to do once an attempt has ended with `outcome` (None: every rank exited 0).

    `workload_stop` is the reason of a rank's request to stop restarting (SHUTDOWN_WORKLOAD,
    or EXCLUDE_THIS_NODE on a single node), if one was made; `stuck`, that attempts in a row
    made no progress.
    """
    if outcome is None:
        return Decision(Action.SUCCEED, "every rank exited 0")
    if outcome.kind == "fatal":
        return Decision(Action.FAIL, outcome.reason)
    if workload_stop is not None:
        return Decision(Action.FAIL, f"{outcome.reason}; {NOT_RESTARTED}{workload_stop}")
    if stuck is not None and outcome.counted:
        return Decision(
            Action.FAIL, f"{outcome.reason}; {CANNOT_HELP}{stuck.reason}", stuck.exit_code
        )
    if not outcome.counted:
        return Decision(Action.RESTART, f"{outcome.reason}; restart not counted")
    if restarts_used >= max_restarts:
        return Decision(
            Action.FAIL,
            f"{outcome.reason}; {NO_RESTARTS_LEFT} ({restarts_used}/{max_restarts} used)",
        )
    return Decision(
        Action.RESTART,
        f"{outcome.reason}; restart {restarts_used + 1}/{max_restarts}",
    )


def counts_healthy_nodes(restart_policy: RestartPolicy) -> bool:
    """Whether a lost node's round asks the coordinator how many healthy nodes are left
    before `after_node_lost` decides (else every other member counts as healthy)."""
    return restart_policy is RestartPolicy.MIN_HEALTHY


def after_node_lost(
    reason: str, restart_policy: RestartPolicy, healthy_left: int, nnodes_min: int
) -> Decision:
    """What to do when a member of the round stopped answering (liveness.judge said so):
    restart every node without it, unless --restart-policy min-healthy and enough healthy
    nodes are left to go on."""
    if restart_policy is RestartPolicy.MIN_HEALTHY and healthy_left >= nnodes_min:
        return Decision(
            Action.CONTINUE,
            f"{reason}; {healthy_left} healthy nodes left: no restart (min-healthy)",
        )
    return Decision(Action.RESTART, f"{reason}; restart not counted")


def restart_backoff(fast_failures: int, base_s: float, cap_s: float) -> float:
    """CrashLoopBackOff's shape: the first restart after a failure is immediate; each further
    attempt in a row that failed fast waits twice as long as the one before, up to the cap."""
    if fast_failures <= 1 or base_s <= 0:
        return 0.0
    return float(min(cap_s, base_s * 2 ** (fast_failures - 2)))


def asks_the_healthy_first(decision: Decision, restart_policy: RestartPolicy) -> bool:
    """Whether this node, about to ask for a restart, first marks itself unhealthy and lets
    the round go on while MIN healthy nodes are left (--restart-policy min-healthy)."""
    return decision.action is Action.RESTART and restart_policy is RestartPolicy.MIN_HEALTHY
