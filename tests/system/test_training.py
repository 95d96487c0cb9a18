"""Training-loop integration: hooks, simulated faults, ft_launcher compatibility."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path

from tests.conftest import BIN, ROOT, Serve, ServeFactory

EXAMPLE = ROOT / "examples" / "train_sections.py"
TIMEOUTS = (
    "--ft-param-rank_section_timeouts=setup:20,step:5,checkpointing:30",
    "--ft-param-rank_out_of_section_timeout=30",
)
PRELOAD = ("--preload", "torch._dynamo")
"""DistributedDataParallel imports torch._dynamo when it wraps the model (1.5-2 CPU-s): the
zygote imports it once per daemon instead of every rank of every attempt. test_serve.py's
crash-and-resume of examples/train_ddp.py keeps the default preload."""


def assert_resumed_from_newest_checkpoint(run: Serve) -> None:
    """Attempt 1 resumed from the last checkpoint attempt 0 wrote (if it got to write one)."""
    saved = re.findall(r"\[attempt 0\] checkpoint at step (\d+)", run.stdout.text)
    if saved:
        assert f"[attempt 1] resumed from step_{int(saved[-1]):06d}.pt" in run.stdout.text
    assert "[attempt 1] finished" in run.stdout.text


async def train(serve: ServeFactory, tmp_path: Path, fault: str, *extra: str) -> Serve:
    return await serve(
        "--nproc-per-node", "2", "--max-restarts", "2", *TIMEOUTS, *PRELOAD,
        f"--ft-param-simulated_fault={fault}", *extra,
        script=EXAMPLE,
        script_args=(
            *("--steps", "60", "--step-time", "0.1", "--ckpt-every", "2"),
            *("--ckpt-dir", str(tmp_path / "ck")),
        ),
    )  # fmt: skip


async def test_simulated_hang_is_caught_in_its_step_and_training_resumes(
    serve: ServeFactory, tmp_path: Path
) -> None:
    run = await train(serve, tmp_path, "hang:1:5")
    assert await run.wait(timeout=110) == 0, run.stderr.text[-2000:]
    [armed] = run.event_data("fault_armed")
    assert armed["kind"] == "hang" and armed["global_rank"] == 1
    [injected] = run.event_data("fault_injected")
    assert injected["global_rank"] == 1
    hung = run.event_data("rank_hung")[0]
    # Charged to the section the rank was in when the fault struck (on a loaded machine it may
    # still be in setup), or to out-of-section time.
    section = (injected["open_sections"] or [None])[-1]  # type: ignore[index]
    assert hung["global_rank"] == 1 and hung["section"] == section
    if section is not None:  # its own timeout, or a peer waiting on it ran out first (loaded)
        reason = str(hung["reason"])
        assert (
            f"stayed in section '{section}' past its timeout" in reason
            or reason.startswith(
                "rank 1 is carrying out a simulated hang; rank 0 was the first to time out waiting"
            )
            or "; rank 1 is the culprit: it entered" in reason  # rank 0's deadline came first
        ), reason
    assert_resumed_from_newest_checkpoint(run)


async def test_simulated_kill_restarts_from_the_newest_checkpoint(
    serve: ServeFactory, tmp_path: Path
) -> None:
    run = await train(serve, tmp_path, "kill:random:4-5")
    assert await run.wait(timeout=110) == 0, run.stderr.text[-2000:]
    [armed] = run.event_data("fault_armed")
    failed = [e for e in run.event_data("rank_exited") if e["state"] == "failed"]
    assert failed[0]["global_rank"] == armed["global_rank"] and failed[0]["exit_code"] == -9
    assert_resumed_from_newest_checkpoint(run)
    assert not run.event_data("rank_hung")


async def test_learned_timeouts_persist_and_reload(serve: ServeFactory, tmp_path: Path) -> None:
    # A large safety factor: the learned timeouts must hold on a loaded 2-core machine.
    first = await serve(
        "--nproc-per-node", "2", *TIMEOUTS, *PRELOAD, "--ft-param-safety_factor=500",
        script=EXAMPLE,
        script_args=("--steps", "40", "--ckpt-dir", str(tmp_path / "ck"), "--calc-timeouts"),
    )  # fmt: skip
    assert await first.wait(timeout=100) == 0
    state = json.loads((first.run_dir / "ft_state.json").read_text())
    assert {"section:checkpointing", "section:step", "rank_out_of_section_timeout"} <= set(
        state["learned"]
    )
    assert "section:setup" not in state["learned"]  # no persistent checkpoint was loaded
    # The second run resumes from a checkpoint: setup is learned now, from the reloaded state.
    second = await serve(
        "--nproc-per-node", "2", *TIMEOUTS, *PRELOAD, "--ft-param-safety_factor=500",
        script=EXAMPLE,
        script_args=("--steps", "60", "--ckpt-dir", str(tmp_path / "ck"), "--calc-timeouts"),
    )  # fmt: skip
    await second.stderr.expect("loaded learned timeouts")
    assert await second.wait(timeout=100) == 0
    state = json.loads((second.run_dir / "ft_state.json").read_text())
    assert "section:setup" in state["learned"]


async def test_hooks_are_noops_under_torchrun(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTD_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
        str(EXAMPLE), "--steps", "12", "--step-time", "0", "--ckpt-dir", str(tmp_path / "ck"),
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert b"[attempt 0] finished" in out


async def test_nvrx_heartbeat_script_runs_through_a_hang_and_a_crash(serve: ServeFactory) -> None:
    run = await serve(
        "--nproc-per-node", "2", "--max-restarts", "2",
        "--ft-param-initial_rank_heartbeat_timeout=30", "--ft-param-rank_heartbeat_timeout=1",
        script=BIN / "nvrx_heartbeats.py",
    )  # fmt: skip
    assert await run.wait(timeout=60) == 0, run.stderr.text[-2000:]
    assert "rank 1 hb timeouts HeartbeatTimeouts(initial=30.0, subsequent=1.0" in run.stdout.text
    assert "sent no heartbeat within rank_heartbeat_timeout" in run.stderr.text
    assert "failed with exit code 7" in run.stderr.text
    assert "rank 0 attempt 2 done" in run.stdout.text
    assert "valid=True" in run.stdout.text


async def test_nvrx_section_script_runs_through_a_hang_and_a_crash(serve: ServeFactory) -> None:
    run = await serve(
        "--nproc-per-node", "2", "--max-restarts", "2",
        "--ft-param-rank_section_timeouts=setup:30,step:1",
        script=BIN / "nvrx_sections.py",
    )  # fmt: skip
    assert await run.wait(timeout=60) == 0, run.stderr.text[-2000:]
    # Timed by the configured 1 s, or by what rank 1 learned when it finished first.
    assert "stayed in section 'step' past its timeout" in run.stderr.text
    assert "failed with signal SIGKILL" in run.stderr.text
    assert "rank 1 attempt 2 done" in run.stdout.text
    assert "calculated_sections={'step'}" in run.stdout.text
