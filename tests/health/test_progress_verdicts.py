"""Hang verdicts for an unmodified DDP script (tests/bin/plain_ddp.py: no ftd, no NVRx) from
the progress its ranks report without its help, and the right culprit for an instrumented one
(ftd/health/progress.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import BIN, ServeFactory

PLAIN_DDP = BIN / "plain_ddp.py"
TRAIN_DDP = Path(__file__).parents[2] / "examples" / "train_ddp.py"
SLOW_PHASES = (
    "--steps", "30", "--ckpt-every", "10", "--slow-save", "10", "--eval-seconds", "10",
    "--epochs", "3",
)  # fmt: skip


@pytest.mark.parametrize("start_method", ["zygote", "spawn"])
async def test_an_unmodified_script_whose_rank_stops_is_judged_with_the_right_culprit(
    serve: ServeFactory, tmp_path: Path, start_method: str
) -> None:
    # Under spawn, the verdict only: each spawned DDP rank imports torch and torch._dynamo
    # (~4 CPU-s); the resume after the restart is the same under both start methods.
    restarts = 1 if start_method == "zygote" else 0
    run = await serve(
        "--start-method",
        start_method,
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(restarts),
        "--progress-timeout-floor",
        "5",
        script=PLAIN_DDP,
        script_args=("--steps", "60", "--stop-at-step", "40", "--ckpt-dir", str(tmp_path / "c")),
    )
    assert await run.wait(timeout=240) == 1 - restarts, run.stderr.text[-3000:]
    [hung] = run.event_data("rank_hung")
    assert hung["global_rank"] == 1 and hung["culprit"] is True, hung
    assert hung["victims"] == [0], hung
    assert "the culprit, it has not entered collective" in hung["reason"], hung
    for local_rank in (0, 1):  # every rank's Python stacks, though the script registered none
        stacks = (run.attempt_dir(0) / str(local_rank) / "stacks.txt").read_text()
        assert "plain_ddp.py" in stacks, stacks
    assert "threading.py" in (run.attempt_dir(0) / "1" / "stacks.txt").read_text()
    if restarts:
        assert "rank 1: resumed at step 40" in run.stdout.text  # from its checkpoint
        assert "rank 0: finished 60 steps" in run.stdout.text


async def test_long_phases_without_steps_are_no_hang(serve: ServeFactory, tmp_path: Path) -> None:
    """With the floor at 5 s: rank 0 spends 10 s in torch.save while rank 1 waits in the
    barrier; then every rank evaluates for 10 s (an all_reduce every 100 ms, no step); every
    epoch starts a new DataLoader iterator with workers."""
    run = await serve(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        "--progress-timeout-floor",
        "5",
        script=PLAIN_DDP,
        script_args=(*SLOW_PHASES, "--ckpt-dir", str(tmp_path / "c")),
    )
    assert await run.wait(timeout=240) == 0, run.stderr.text[-3000:]
    assert "rank 0: a slow torch.save (10s)" in run.stdout.text
    assert run.events("rank_hung") == []


async def test_a_heartbeat_verdict_blames_the_rank_the_others_wait_on(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """ftd_client's heartbeats (examples/train_ddp.py): rank 1 stops, rank 0 blocks in the next
    allreduce a millisecond later; either may time out first, rank 1 is named."""
    run = await serve(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--ft-param-rank_heartbeat_timeout=3",
        "--ft-param-rank_section_timeouts=setup:120,step:30",
        script=TRAIN_DDP,
        script_args=("--steps", "30", "--hang-at-step", "25", "--ckpt-dir", str(tmp_path / "c")),
    )
    assert await run.wait(timeout=240) == 0, run.stderr.text[-3000:]
    [hung] = run.event_data("rank_hung")
    assert hung["global_rank"] == 1 and hung["culprit"] is True, hung
    assert "rank 1 is the culprit" in hung["reason"], hung
    assert hung["victims"] == [0], hung  # one verdict: rank 0 falls due too, as its victim
