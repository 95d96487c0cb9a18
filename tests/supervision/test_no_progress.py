"""A job that knows when to stop (issue 40 item 4): attempts in a row that do not move the
checkpoint iteration end the job on every node with --ft-no-restart-exit-code (93)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from ftd.config.ft import FaultToleranceConfig
from ftd.status.events import EventLog
from ftd.status.model import Failure
from ftd.supervision.no_progress import NoProgress, ProgressGuard, decode_iteration
from ftd.supervision.policy import Action, Stuck, after_attempt
from tests.conftest import BIN, ServeFactory, events_in
from tests.support.api import cli
from tests.support.cluster import Cluster, run_dir
from tests.support.fuzzing import budget, fuzz_target

STUCK_RANK = BIN / "stuck_rank.py"


def test_three_attempts_without_progress_stop_the_job() -> None:
    tracker = NoProgress(max_cycles=3)
    assert tracker.attempt_ended(4) is None  # 0 -> 4: progress
    assert tracker.attempt_ended(4) is None and tracker.attempt_ended(4) is None
    reason = tracker.attempt_ended(4)
    assert reason is not None and reason.startswith("no progress in 3 attempts"), reason
    assert "stayed at 4" in reason


def test_progress_resets_the_count_and_unknown_iterations_judge_nothing() -> None:
    tracker = NoProgress(max_cycles=2, min_iterations=10)
    assert tracker.attempt_ended(None) is None and tracker.without == 0
    assert tracker.attempt_ended(5) is None and tracker.without == 1  # +5 < 10
    assert tracker.attempt_ended(20) is None and tracker.without == 0  # +15
    assert tracker.attempt_ended(None) is None and tracker.without == 0
    assert tracker.attempt_ended(21) is None
    assert tracker.attempt_ended(3) is not None  # an older checkpoint: no progress either
    assert NoProgress(max_cycles=0).attempt_ended(1) is None
    assert NoProgress(max_cycles=-1).attempt_ended(1) is None


@given(st.integers(1, 5), st.integers(1, 3), st.lists(st.none() | st.integers(0, 30)))
def test_the_job_stops_exactly_after_max_cycles_attempts_in_a_row_without_progress(
    max_cycles: int, min_iterations: int, iterations: list[int | None]
) -> None:
    tracker = NoProgress(max_cycles, min_iterations)
    best, without = 0, 0
    for iteration in iterations:
        reason = tracker.attempt_ended(iteration)
        if iteration is None:
            assert reason is None
            continue
        without = 0 if iteration - best >= min_iterations else without + 1
        best = max(best, iteration)
        assert (reason is not None) == (without >= max_cycles)


def test_the_policy_stops_with_the_stuck_code_and_restarts_running_out_keep_1() -> None:
    failure = Failure(kind="exit", reason="rank 0 exited with code 1", timestamp=1.0)
    decision = after_attempt(failure, 1, 10, stuck=Stuck("no progress in 3 attempts", 93))
    assert (decision.action, decision.exit_code) == (Action.FAIL, 93)
    assert "restarting cannot help: no progress in 3 attempts" in decision.reason
    out = after_attempt(failure, 3, 3)
    assert (out.action, out.exit_code) == (Action.FAIL, 1)


class Memory:
    def __init__(self) -> None:
        self.step: int | None = None

    def newest_step(self) -> int | None:
        return self.step


def test_the_memory_tier_is_the_iteration_where_no_file_is_named(tmp_path: Path) -> None:
    events = EventLog(None)
    guard = ProgressGuard(FaultToleranceConfig(max_no_progress_cycles=2), events)
    memory = Memory()
    assert guard.after_failure(0, None, memory) is None  # nothing saved yet: not judged
    memory.step = 4
    assert guard.after_failure(1, None, memory) is None
    assert guard.after_failure(2, None, memory) is None
    stuck = guard.after_failure(3, None, memory)
    assert stuck == Stuck(stuck.reason if stuck else "", 93) and stuck is not None
    [event] = [e for e in events.since(0) if e.kind == "no_progress"]
    assert event.data["attempts"] == 2 and event.data["iteration"] == 4
    iteration_file = tmp_path / "iteration"
    iteration_file.write_text("7\n")
    ft = FaultToleranceConfig(checkpoint_iteration_file=str(iteration_file), no_restart_exit_code=7)
    named = ProgressGuard(ft, EventLog(None))
    assert named.after_failure(0, None, memory) is None and named.tracker.last == 7


@fuzz_target("iteration_file", 300)
@given(st.one_of(st.binary(max_size=80), st.integers(-(2**70), 2**70).map(lambda n: b"%d" % n)))
def test_any_iteration_file_is_an_iteration_or_unknown(data: bytes) -> None:
    with budget():
        value = decode_iteration(data)
    assert value is None or 0 <= value < 2**63


async def test_a_job_that_fails_at_step_5_every_attempt_stops_with_93_on_every_node(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """Two nodes; node a's rank fails in step 5 of every attempt, after resuming from the
    iteration it wrote (4): after 3 attempts in a row without progress the job is not
    restarted, though restarts are left, and both nodes exit 93 naming why."""
    iteration = tmp_path / "iteration"
    cluster = Cluster(serve, "2", "--max-restarts", "10")
    flags = (
        *cluster.flags,
        "--ft-max-no-progress-cycles", "3",
        "--ft-checkpoint-iteration-file", str(iteration),
    )  # fmt: skip
    args = ("--iteration-file", str(iteration), "--fail-at", "5")
    nodes = []
    for node in ("a", "b"):
        run = await serve("--node-id", node, *flags, run_id="job", script=STUCK_RANK,
                          script_args=args, env=cluster.env)  # fmt: skip
        if node == "a":
            await run.stderr.expect(cluster.backend.in_rendezvous)
        nodes.append(run)
    a, b = nodes
    codes = await asyncio.gather(a.wait(timeout=180), b.wait(timeout=180))
    assert codes == [93, 93], (a.stderr.text[-3000:], b.stderr.text[-3000:])
    assert a.stdout.text.count("fails in step 5") == 4, a.stdout.text
    assert (
        "the job failed and was not restarted: restarting cannot help: no progress in 3 "
        "attempts (the checkpoint iteration stayed at 4" in a.stderr.text
    ), a.stderr.text[-3000:]
    for run, node in ((a, "a"), (b, "b")):
        shown = cli("status", "--run-dir", str(run_dir(run, node)))
        assert "no progress in 3 attempts" in shown.stdout, shown.stdout + shown.stderr
    [stuck] = events_in(run_dir(a, "a"), "no_progress")
    assert stuck["data"]["attempts"] == 3 and stuck["data"]["exit_code"] == 93, stuck
