"""Restart decisions: pure functions of the state, returning an action and a reason."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ftd.state import Failure


class Action(enum.StrEnum):
    SUCCEED = "succeed"
    RESTART = "restart"
    FAIL = "fail"


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str


def after_attempt(
    outcome: Failure | None,
    restarts_used: int,
    max_restarts: int,
    workload_stop: str | None = None,
) -> Decision:
    """What to do once an attempt has ended with `outcome` (None: every rank exited 0).

    `workload_stop` is the reason of a rank's request to stop restarting (SHUTDOWN_WORKLOAD,
    or EXCLUDE_THIS_NODE on a single node), if one was made.
    """
    if outcome is None:
        return Decision(Action.SUCCEED, "every rank exited 0")
    if outcome.kind == "fatal":
        return Decision(Action.FAIL, outcome.reason)
    if workload_stop is not None:
        return Decision(Action.FAIL, f"{outcome.reason}; not restarted: {workload_stop}")
    if not outcome.counted:
        return Decision(Action.RESTART, f"{outcome.reason}; restart not counted")
    if restarts_used >= max_restarts:
        return Decision(
            Action.FAIL,
            f"{outcome.reason}; no restarts left ({restarts_used}/{max_restarts} used)",
        )
    return Decision(
        Action.RESTART,
        f"{outcome.reason}; restart {restarts_used + 1}/{max_restarts}",
    )
