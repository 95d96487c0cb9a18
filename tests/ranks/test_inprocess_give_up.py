"""The in-process fallback writes the stragglers' stacks before it fails the attempt, through
the hook the daemon wires (InprocessRounds(explain_stragglers=health.hangs.explain_ranks))."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ftd.ranks.inprocess import InprocessRounds
from ftd.status.events import EventLog
from ftd.status.model import Failure


class _Group:
    """Records the failure (WorkerGroup.fail) instead of stopping processes."""

    def __init__(self) -> None:
        self.statuses = {0: SimpleNamespace(pid=100), 1: SimpleNamespace(pid=101)}
        self.failures: list[Failure] = []

    def fail(self, failure: Failure) -> None:
        self.failures.append(failure)


def rounds(group: _Group, explain: Any) -> InprocessRounds:
    async def budget(failure: Failure) -> bool:
        return True

    made = InprocessRounds(
        store_addr=("127.0.0.1", 0),
        prefix="t",
        world_size=4,
        local_slots={0: 2, 1: 3},  # this node runs slots 2 and 3
        leader=True,
        first_round_store=("127.0.0.1", 0),
        fresh_round_store=lambda: ("127.0.0.1", 0),  # type: ignore[arg-type,return-value]
        respawn=True,
        respawn_budget=budget,
        events=EventLog(None),
        node_id="n",
        explain_stragglers=explain,
    )
    made._group = group  # type: ignore[assignment]  # attach() would start the leader's task
    return made


async def test_stragglers_stacks_are_written_before_the_attempt_fails() -> None:
    group = _Group()
    asked: list[list[int]] = []

    async def explain(local_ranks: list[int]) -> list[str]:
        assert not group.failures  # before the attempt is failed
        asked.append(local_ranks)
        return [f"rank {r + 2}: Python stacks in attempt_0/{r}/stacks.txt" for r in local_ranks]

    await rounds(group, explain)._give_up(5, [1, 3], 90.0)
    assert asked == [[1]]  # slot 3 is local rank 1 here; slot 1 lives on another node
    [failure] = group.failures
    assert failure.kind == "hang" and "round 5" in failure.reason
    assert "rank 3: Python stacks in attempt_0/1/stacks.txt" in failure.reason


async def test_a_failing_explanation_never_stops_the_fallback() -> None:
    group = _Group()

    async def explain(local_ranks: list[int]) -> list[str]:
        raise OSError("disk full")

    await rounds(group, explain)._give_up(2, [2], 90.0)
    [failure] = group.failures
    assert "stacks not collected (OSError('disk full'))" in failure.reason
