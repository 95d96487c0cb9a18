"""The restart policy (ftd.supervision.policy.after_attempt): a pure decision after each attempt."""

from __future__ import annotations

import pytest

from ftd.status.model import Failure
from ftd.supervision.policy import Action, after_attempt


@pytest.mark.parametrize(
    ("outcome", "used", "expected"),
    [
        (None, 0, Action.SUCCEED),
        (Failure(kind="exit", reason="x"), 0, Action.RESTART),
        (Failure(kind="exit", reason="x"), 3, Action.FAIL),
        (Failure(kind="fatal", reason="x"), 0, Action.FAIL),
        (Failure(kind="request", reason="x", counted=False), 3, Action.RESTART),
    ],
)
def test_restart_policy(outcome: Failure | None, used: int, expected: Action) -> None:
    decision = after_attempt(outcome, used, 3)
    assert decision.action is expected and decision.reason


def test_workload_shutdown_stops_restarting() -> None:
    decision = after_attempt(Failure(kind="exit", reason="boom"), 0, 3, "rank 1 asked")
    assert decision.action is Action.FAIL and "not restarted: rank 1 asked" in decision.reason
