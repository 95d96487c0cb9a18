"""`ftd serve` end to end: real daemons, real ranks, real gloo groups."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, WORKER, Serve, ServeFactory, pids_with_env, wait_pids_gone

EXAMPLE = ROOT / "examples" / "train_ddp.py"


async def test_success_path_and_log_layout(serve: ServeFactory) -> None:
    run = await serve("--nproc-per-node", "2", "--redirects", "3", script_args=("--say", "hi"))
    assert await run.wait() == 0
    assert run.status()["state"] == "succeeded"
    for local_rank in (0, 1):
        rank_dir = run.attempt_dir(0) / str(local_rank)
        stdout = (rank_dir / "stdout.log").read_text().splitlines()
        assert stdout[0] == f"hi out rank {local_rank}"
        assert (rank_dir / "stderr.log").read_text() == f"hi err rank {local_rank}\n"
    # Redirected: nothing of the ranks reaches the console.
    assert "hi out" not in run.stdout.text and "hi err" not in run.stderr.text


async def test_tee_writes_files_and_console(serve: ServeFactory) -> None:
    run = await serve(
        "--nproc-per-node",
        "2",
        "--tee",
        "1",
        "--local-ranks-filter",
        "1",
        script_args=("--say", "t"),
    )
    assert await run.wait() == 0
    for local_rank in (0, 1):
        stdout = (run.attempt_dir(0) / str(local_rank) / "stdout.log").read_text()
        assert stdout.startswith(f"t out rank {local_rank}\n")
    # Tee'd to the console with torchrun's prefix, and only for the filtered local rank.
    assert "[default1]:t out rank 1" in run.stdout.text
    assert "t out rank 0" not in run.stdout.text
    # stderr was not tee'd: it went straight to the console, unfiltered ranks silenced.
    assert "t err rank 1" in run.stderr.text


async def test_no_python_runs_the_binary_with_its_arguments(serve: ServeFactory) -> None:
    run = await serve(
        "--nproc-per-node", "2", "--no-python", "--redirects", "3",
        script="echo", script_args=("binary", "args"),
    )  # fmt: skip
    assert await run.wait() == 0
    for local_rank in (0, 1):
        stdout = (run.attempt_dir(0) / str(local_rank) / "stdout.log").read_text()
        assert stdout == "binary args\n"


async def test_crash_restart_resumes_from_checkpoint(serve: ServeFactory, tmp_path: Path) -> None:
    run = await serve(
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        script=EXAMPLE,
        script_args=(
            *("--steps", "30", "--ckpt-every", "10", "--crash-at-step", "15"),
            *("--ckpt-dir", str(tmp_path / "ckpt")),
        ),
        run_id="none",
    )
    assert await run.wait(timeout=100) == 0
    assert "[attempt 0] step 10 loss" in run.stdout.text
    assert "[attempt 1] resumed from step_00000010.pt at step 10" in run.stdout.text
    assert "[attempt 1] finished 30 steps" in run.stdout.text
    assert "rank 1 (local 1, pid" in run.stderr.text
    assert "restart 1/2" in run.stderr.text


async def test_restarts_exhausted_summary_from_error_json(serve: ServeFactory) -> None:
    run = await serve(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        script_args=("--fail-attempts", "99", "--fail-rank", "1", "--record"),
    )
    assert await run.wait() == 1
    status = run.status()
    assert status["state"] == "failed" and status["restart_count"] == 1
    text = run.stderr.text
    summary = text[text.index("restarts exhausted") :]
    assert "worker.py FAILED" in summary
    assert "Root Cause (first observed failure)" in summary
    assert "rank      : 1 (local_rank: 1)" in summary
    assert "exitcode  : 1" in summary
    assert "RuntimeError: injected failure on rank 1 attempt 1" in summary
    error_file = run.attempt_dir(1) / "1" / "error.json"
    assert str(error_file) in summary
    assert json.loads(error_file.read_text())["message"]["message"].startswith("RuntimeError")
    # The job's failure, not a traceback of ftd itself.
    assert "ftd/daemon.py" not in text and "ftd/ranks/workers.py" not in text


async def test_signal_death_reported_by_name(serve: ServeFactory) -> None:
    run = await serve(
        "--nproc-per-node",
        "2",
        script_args=("--fail-attempts", "1", "--fail-rank", "0", "--fail-mode", "signal:SIGSEGV"),
    )
    assert await run.wait() == 1
    assert "failed with signal SIGSEGV (11)" in run.stderr.text
    assert "Signal 11 (SIGSEGV) received by PID" in run.stderr.text


async def test_exit_code_reported(serve: ServeFactory) -> None:
    run = await serve(
        script_args=("--fail-attempts", "1", "--fail-mode", "exit:7"),
    )
    assert await run.wait() == 1
    assert "failed with exit code 7" in run.stderr.text
    assert run.status()["last_failure"]["exit_code"] == 7  # type: ignore[index]


async def test_sigterm_stops_every_process(serve: ServeFactory) -> None:
    run = await serve("--nproc-per-node", "2", script_args=("--hang", "--children"))
    await run.stderr.expect(r"state rendezvous -> running")
    children = await _children_when_ready(run)
    ranks = await run.rank_pids(0)
    run.signal(signal.SIGTERM)
    assert await run.wait() == 128 + signal.SIGTERM
    assert run.status()["state"] == "stopped"
    assert await wait_pids_gone(ranks + children, timeout=1) == []
    assert pids_with_env("FTD_RUN_DIR", str(run.run_dir)) == []


async def test_sigkill_of_daemon_takes_ranks_with_it(serve: ServeFactory) -> None:
    run = await serve("--nproc-per-node", "2", script_args=("--hang", "--children"))
    children = await _children_when_ready(run)
    ranks = await run.rank_pids(0)
    run.signal(signal.SIGKILL)
    assert await run.wait() == -signal.SIGKILL
    assert await wait_pids_gone(ranks + children, timeout=10) == []
    assert pids_with_env("FTD_RUN_DIR", str(run.run_dir)) == []


async def test_second_sigint_forces_the_kill(serve: ServeFactory) -> None:
    run = await serve(
        "--nproc-per-node",
        "2",
        "--shutdown-timeout",
        "60",
        script_args=("--hang", "--ignore-sigterm"),
    )
    for rank in (0, 1):
        await run.stdout.expect(f"ready a0 r{rank}")
    run.signal(signal.SIGINT)
    await run.stderr.expect(r"sending SIGTERM to local rank 1")
    run.signal(signal.SIGINT)
    assert await run.wait(timeout=20) == 128 + signal.SIGINT
    assert "killing the workers now" in run.stderr.text


@pytest.mark.timeout(400)
async def test_ten_restarts_of_four_gloo_ranks(serve: ServeFactory) -> None:
    """Every attempt's ranks meet in a fresh store: no attempt fails at init (#135712)."""
    run = await serve(
        "--nproc-per-node",
        "4",
        "--max-restarts",
        "10",
        "--restart-backoff",
        "0",  # ten attempts failing fast in a row: no crash-loop back-off here
        script_args=("--allreduce", "--fail-attempts", "10", "--fail-rank", "rotate"),
    )
    assert await run.wait(timeout=280) == 0
    for attempt in range(11):
        for rank in range(4):
            assert (run.out / f"allreduce_a{attempt}_r{rank}").exists(), (attempt, rank)
    # Each attempt failed only by the injected fault, never at process-group set-up.
    for attempt in range(10):
        assert f"rank {attempt % 4} (local {attempt % 4}, pid" in run.stderr.text
    assert "connectFullMesh" not in run.stderr.text


async def test_worker_env_matches_torchrun(serve: ServeFactory, tmp_path: Path) -> None:
    import asyncio

    torchrun_out = tmp_path / "torchrun"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        str(WORKER),
        "--out",
        str(torchrun_out),
        "--dump-env",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
    )
    run = await serve(
        "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", script_args=("--dump-env",)
    )
    assert await asyncio.wait_for(proc.wait(), 90) == 0
    assert await run.wait() == 0
    must_differ = {
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_ERROR_FILE",
        "TORCHELASTIC_USE_AGENT_STORE",  # torchrun False under the store-sharing workaround
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",  # set above for torchrun only
    }
    for rank in (0, 1):
        theirs = _read_json(torchrun_out / f"env_{rank}.json")
        ours = _read_json(run.out / f"env_{rank}.json")
        extra = {k for k in ours if k not in theirs}
        # FTD_* and ft_launcher's FT_*_IPC_SOCKET (NVRx's own client reads those).
        assert {k for k in extra if not k.startswith(("FTD_", "FT_"))} == set()
        assert {k for k in theirs if k not in ours} - must_differ == set()
        differing = {k for k in theirs if k in ours and theirs[k] != ours[k]}
        assert differing <= must_differ, {k: (theirs[k], ours[k]) for k in differing}
        assert ours["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert ours["TORCHELASTIC_ERROR_FILE"].endswith(f"attempt_0/{rank}/error.json")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bogus-flag", "x.py"], "unrecognized arguments: --bogus-flag"),
        (["missing_script.py"], "entrypoint: training script 'missing_script.py' does not exist"),
        (["--no-python", "no-such-binary-xyz"], "not an executable file or on PATH"),
        (["--nproc-per-node", "0", str(WORKER)], "--nproc-per-node: Input should be greater"),
        (["--nnodes", "3:2", str(WORKER)], "nnodes: MIN 3 is above MAX 2"),
        (["--log-dir", "/proc/ftd-logs", str(WORKER)], "--log-dir: '/proc' is not writable"),
        (["--redirects", "9", str(WORKER)], "redirects: expected 0-3"),
    ],
)
async def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], message: str, tmp_path: Path
) -> None:
    import asyncio

    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "ftd",
        "serve",
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=str(tmp_path),
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    lines = stderr.decode().strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("ftd serve: error: ")
    assert message in lines[0]
    assert stdout == b""
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing written


def _read_json(path: Path) -> dict[str, str] | list[int]:
    data: dict[str, str] | list[int] = json.loads(path.read_text())
    return data


async def _children_when_ready(run: Serve) -> list[int]:
    """Both ranks are up: the pids of the child and the escaped (setsid) child each started."""
    children = []
    for rank in (0, 1):
        match = await run.stdout.expect(rf"children r{rank} (\d+) (\d+)")
        children += [int(match[1]), int(match[2])]
        await run.stdout.expect(f"ready a0 r{rank}")
    return children
