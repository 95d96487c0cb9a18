"""`--start-method zygote`: ranks forked from a preloaded zygote look to the daemon, and to
themselves, like ranks started as subprocesses."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BIN, ROOT, WORKER, ServeFactory, pids_with_env, wait_pids_gone

ZYGOTE = ("--start-method", "zygote")
BARE_ZYGOTE = (*ZYGOTE, "--preload", "none")
"""For the zygote's mechanics (exits, signals, its death, the daemon's): no torch import (2-3
CPU-s). What a rank forked with torch loaded gets is the other tests' subject."""
TRAPS = BIN / "zygote_traps.py"
READY = r"zygote \(pid (\d+)\) ready"
FALLBACK = "starting the ranks the ordinary way"
# Values that differ between two runs whatever starts the ranks.
PER_RUN = {
    "MASTER_PORT",
    "FTD_RUN_DIR",
    "FTD_DAEMON_ID",
    "FTD_SOCKET",
    "FTD_STACKS_FILE",
    "FT_RANK_MONITOR_IPC_SOCKET",
    "FT_LAUNCHER_IPC_SOCKET",
    "TORCHELASTIC_ERROR_FILE",
}


def _report(out: Path, rank: int, attempt: int = 0) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / f"report_a{attempt}_r{rank}.json").read_text())
    return data


async def test_crash_restart_and_gloo_allreduce(serve: ServeFactory) -> None:
    run = await serve(
        *ZYGOTE,
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        script_args=("--allreduce", "--fail-attempts", "1", "--fail-rank", "1"),
    )
    assert await run.wait() == 0
    for attempt in (0, 1):
        for rank in (0, 1):
            assert (run.out / f"allreduce_a{attempt}_r{rank}").exists(), (attempt, rank)
    text = run.stderr.text
    assert len(re.findall(READY, text)) == 1  # one zygote served both attempts
    assert FALLBACK not in text
    assert "did not end on EOF" not in text  # the daemon's close ended it at once
    assert "rank 1 (local 1, pid" in text and "restart 1/1" in text
    # The traceback is the script's, as python prints it, without the zygote's frames.
    assert "RuntimeError: injected failure on rank 1 attempt 0" in text
    assert "rank_main.py" not in text and "zygote_server.py" not in text


async def test_rank_gets_what_a_fresh_interpreter_has(serve: ServeFactory, tmp_path: Path) -> None:
    """The same script under both start methods; the zygote preloads a module that leaves
    signal handlers, faulthandler and an env var behind, none of which may reach a rank."""
    runs = {}
    for method, extra in (("subprocess", ()), ("zygote", ("--preload", "tests.bin.zygote_dirty"))):
        runs[method] = await serve(
            "--start-method",
            method,
            *extra,
            "--nproc-per-node",
            "2",
            "--redirects",
            "3",
            script=TRAPS,
            script_args=("--out", str(tmp_path / method), "--info", "--allreduce", "--atexit"),
            run_id=method,
        )
    for run in runs.values():
        assert await run.wait() == 0
    sub = {rank: _report(tmp_path / "subprocess", rank) for rank in (0, 1)}
    zyg = {rank: _report(tmp_path / "zygote", rank) for rank in (0, 1)}
    for rank in (0, 1):
        theirs, ours = sub[rank], zyg[rank]
        assert (theirs["preloaded"], ours["preloaded"]) == (False, True)
        # Every rank is a child of its daemon and leads its own session.
        assert theirs["ppid"] == runs["subprocess"].proc.pid
        assert ours["ppid"] == runs["zygote"].proc.pid
        assert ours["session_leader"] and ours["group_leader"]
        assert ours["pdeathsig"] == signal.SIGKILL
        for key in (
            "name",
            "main_is_this",
            "file",
            "spec",
            "path",
            "cwd",
            "signals",
            "blocked",
            "faulthandler",
            "write_through",
            "torch_threads",  # OMP_NUM_THREADS=1 with two ranks
            "threads",
            "allreduce",
        ):
            assert ours[key] == theirs[key], key
        assert ours["argv"][0] == theirs["argv"][0] == str(TRAPS)
        assert ours["orig_argv"][:3] == theirs["orig_argv"][:3]
        assert set(ours["env"]) == set(theirs["env"])  # FTD_TEST_DIRTY did not leak
        differing = {k for k in ours["env"] if ours["env"][k] != theirs["env"][k]}
        assert differing <= PER_RUN | {"TORCHELASTIC_RUN_ID"}, differing
        # A redirected stream is a pipe the daemon reads (a full disk cannot fail a print).
        assert "pipe:[" in ours["stdout_is_log"] and "pipe:[" in theirs["stdout_is_log"]
        # Output written without a newline, by atexit handlers and to files left open.
        for method, run in runs.items():
            rank_dir = run.attempt_dir(0) / str(rank)
            assert (
                rank_dir / "stdout.log"
            ).read_text() == f"no newline r{rank}atexit ran r{rank}\n"
            out = tmp_path / method
            assert (out / f"unclosed_r{rank}").read_text() == "flushed when the interpreter ends"
            assert (out / f"thread_r{rank}").exists()  # non-daemon threads joined before exit
    # Random state is each rank's own.
    assert zyg[0]["random"] != zyg[1]["random"] and zyg[0]["np_random"] != zyg[1]["np_random"]


@pytest.mark.timeout(240)
async def test_dataloader_workers_mp_spawn_and_exit_code(
    serve: ServeFactory, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    env = {
        k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    }
    fresh = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import os, numpy, torch;"
        "print(len(os.listdir('/proc/self/task')), torch.get_num_threads())",
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    fresh_out, _ = await fresh.communicate()
    run = await serve(
        *ZYGOTE,
        script=TRAPS,
        script_args=("--out", str(out), "--info", "--dataloader", "--mp-spawn", "--atexit"),
        env=env,
    )
    # One rank, so no OMP_NUM_THREADS: thread pools sized as in a fresh process.
    assert await run.wait(timeout=220) == 0
    report = _report(out, 0)
    assert report["preloaded"]
    for context in ("fork", "spawn"):
        assert report["dataloader"][context] == {"sum": sum(i * i for i in range(8)), "workers": 2}
    assert report["mp_spawn"] == ["mp_spawn_r0_0", "mp_spawn_r0_1"]
    threads, torch_threads = map(int, fresh_out.split())
    assert (report["threads"], report["torch_threads"]) == (threads, torch_threads)
    assert "atexit ran r0" in run.stdout.text


async def test_error_file_and_exit_status_as_with_subprocess(serve: ServeFactory) -> None:
    runs = {
        method: await serve(
            "--start-method",
            method,
            "--nproc-per-node",
            "2",
            script_args=("--fail-attempts", "1", "--fail-rank", "1", "--record"),
            run_id=method,
        )
        for method in ("subprocess", "zygote")
    }
    errors, failures = {}, {}
    for method, run in runs.items():
        assert await run.wait() == 1
        status = run.status()
        failure: dict[str, Any] = dict(status["last_failure"])  # type: ignore[call-overload]
        failure["reason"] = re.sub(r"pid \d+", "pid N", failure["reason"])
        failures[method] = failure
        errors[method] = json.loads((run.attempt_dir(0) / "1" / "error.json").read_text())
        summary = run.stderr.text[run.stderr.text.index("restarts exhausted") :]
        assert "exitcode  : 1" in summary and "rank      : 1 (local_rank: 1)" in summary
        assert "RuntimeError: injected failure on rank 1 attempt 0" in summary
    assert FALLBACK not in runs["zygote"].stderr.text
    ours, theirs = errors["zygote"], errors["subprocess"]
    assert _shape(ours) == _shape(theirs)
    assert ours["message"]["message"] == theirs["message"]["message"]
    same = {k for k in failures["zygote"] if k not in ("pid", "timestamp", "error_file")}
    assert {k: failures["zygote"][k] for k in same} == {k: failures["subprocess"][k] for k in same}


def _shape(value: object) -> object:
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    return type(value).__name__


@pytest.mark.parametrize(
    ("fail_mode", "expected", "code"),
    [
        ("signal:SIGSEGV", "failed with signal SIGSEGV (11)", -11),
        ("exit:7", "failed with exit code 7", 7),
    ],
)
async def test_signal_and_exit_code_reach_the_daemon(
    serve: ServeFactory, fail_mode: str, expected: str, code: int
) -> None:
    run = await serve(*BARE_ZYGOTE, script_args=("--fail-attempts", "1", "--fail-mode", fail_mode))
    assert await run.wait() == 1
    assert expected in run.stderr.text
    assert run.status()["last_failure"]["exit_code"] == code  # type: ignore[index]


async def test_rank_that_exits_at_once(serve: ServeFactory, tmp_path: Path) -> None:
    script = tmp_path / "exit_now.py"
    script.write_text("raise SystemExit(5)\n")
    run = await serve(*BARE_ZYGOTE, "--nproc-per-node", "2", script=script)
    assert await run.wait() == 1
    assert "failed with exit code 5" in run.stderr.text
    assert FALLBACK not in run.stderr.text


async def test_module_mode_runs_as_python_dash_m(serve: ServeFactory, tmp_path: Path) -> None:
    runs = {
        method: await serve(
            "--start-method",
            method,
            "-m",
            script="tests.bin.zygote_traps",
            script_args=("--out", str(tmp_path / method), "--info"),
            run_id=method,
        )
        for method in ("subprocess", "zygote")
    }
    for run in runs.values():
        assert await run.wait() == 0
    ours, theirs = _report(tmp_path / "zygote", 0), _report(tmp_path / "subprocess", 0)
    assert ours["preloaded"] and not theirs["preloaded"]
    for key in ("name", "main_is_this", "file", "spec", "path", "cwd", "signals"):
        assert ours[key] == theirs[key], key
    assert ours["spec"] == "tests.bin.zygote_traps"
    assert ours["path"][0] == str(ROOT)
    assert ours["argv"][0] == theirs["argv"][0] == str(TRAPS)


async def test_no_python_falls_back_with_the_reason(serve: ServeFactory) -> None:
    run = await serve(*BARE_ZYGOTE, "--no-python", script="true")
    assert await run.wait() == 0
    assert "'true' is not a Python script (--no-python)" in run.stderr.text
    assert FALLBACK in run.stderr.text


async def test_preload_none_forks_ranks_that_import_torch_themselves(serve: ServeFactory) -> None:
    """`--preload none`: the zygote imports nothing; a rank that needs torch imports it."""
    run = await serve(
        *ZYGOTE, "--preload", "none", "--nproc-per-node", "2", script=WORKER,
        script_args=("--allreduce",),
    )  # fmt: skip
    assert await run.wait() == 0
    text = run.stderr.text
    assert "preloading nothing" in text and re.search(READY + r": preloaded nothing", text)
    assert FALLBACK not in text
    assert (run.out / "allreduce_a0_r0").exists() and (run.out / "allreduce_a0_r1").exists()


async def test_the_zygote_warms_ddp_s_imports_once_ranks_ran_a_while(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """The first attempt's ranks start without torch._dynamo (nothing delays them); once they ran
    FTD_ZYGOTE_WARM_AFTER_S, the zygote imports it, and a restarted rank has it (DDP's
    constructor would import it again in every restarted rank: 2.5 s)."""
    out = tmp_path / "warm"
    run = await serve(
        *ZYGOTE, "--max-restarts", "1", script=BIN / "zygote_warm.py", script_args=(str(out),),
        env={"FTD_ZYGOTE_WARM_AFTER_S": "1"},
    )  # fmt: skip
    await run.stderr.expect(r"zygote \(pid \d+\) warmed torch\._dynamo in", timeout=60)
    (out / "go").touch()
    assert await run.wait() == 0
    assert json.loads((out / "dynamo_a0.json").read_text()) is False
    assert json.loads((out / "dynamo_a1.json").read_text()) is True
    text = run.stderr.text
    assert len(re.findall(READY, text)) == 1 and FALLBACK not in text
    assert "could not warm" not in text and "after warming" not in text


def test_preload_none_names_no_other_module(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ftd", "serve", "--standalone", "--preload", "none,json",
         "--log-dir", str(tmp_path), str(WORKER)],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "'none' preloads nothing" in result.stderr and "Traceback" not in result.stderr


async def test_failing_preload_is_shown_and_falls_back(serve: ServeFactory) -> None:
    run = await serve(
        *ZYGOTE, "--preload", "no_such_module_xyz", script_args=("--say", "started anyway")
    )
    assert await run.wait() == 0
    text = run.stderr.text
    assert "--preload failed in the zygote" in text
    assert "ModuleNotFoundError: No module named 'no_such_module_xyz'" in text
    assert FALLBACK in text
    assert "started anyway out rank 0" in run.stdout.text


async def test_zygote_with_threads_refuses_to_fork(serve: ServeFactory) -> None:
    run = await serve(*ZYGOTE, "--preload", "tests.bin.zygote_thread")
    assert await run.wait() == 0
    assert "the zygote holds 1 thread(s) besides its main thread" in run.stderr.text
    assert FALLBACK in run.stderr.text


async def test_dead_zygote_is_restarted_and_none_left_after_sigterm(
    serve: ServeFactory, tmp_path: Path
) -> None:
    run = await serve(
        *BARE_ZYGOTE,
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        script=TRAPS,
        script_args=("--out", str(tmp_path), "--hang"),
    )
    first = int((await run.stderr.expect(READY))[1])
    for rank in (0, 1):
        await run.stdout.expect(f"hanging a0 r{rank}")
    os.kill(first, signal.SIGKILL)
    # Replaced at once, not at the next restart, so that the next restart is warm.
    await run.stderr.expect(rf"zygote \(pid {first}\) died \(signal SIGKILL\); starting a new one")
    os.kill((await run.rank_pids(0))[0], signal.SIGKILL)
    second = int((await run.stderr.expect(rf"zygote \(pid (?!{first}\))(\d+)\) ready"))[1])
    for rank in (0, 1):
        await run.stdout.expect(f"hanging a1 r{rank}")
    assert FALLBACK not in run.stderr.text
    ranks = await run.rank_pids(1)
    run.signal(signal.SIGTERM)
    assert await run.wait() == 128 + signal.SIGTERM
    assert await wait_pids_gone([second, *ranks], timeout=1) == []


async def test_sigkill_of_daemon_leaves_no_zygote_or_rank(serve: ServeFactory) -> None:
    run = await serve(*BARE_ZYGOTE, "--nproc-per-node", "2", script_args=("--hang", "--children"))
    zygote = int((await run.stderr.expect(READY))[1])
    children = []
    for rank in (0, 1):
        match = await run.stdout.expect(rf"children r{rank} (\d+) (\d+)")
        children += [int(match[1]), int(match[2])]
        await run.stdout.expect(f"ready a0 r{rank}")
    ranks = await run.rank_pids(0)
    # Forked ranks show their own command and environment in /proc, as exec'd ones do: the
    # orphan guard's sweep by FTD_DAEMON_ID finds them and their forked descendants.
    assert set(ranks) <= set(pids_with_env("FTD_RUN_DIR", str(run.run_dir)))
    cmdline = Path(f"/proc/{ranks[0]}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    assert cmdline[1:3] == [b"-u", str(WORKER).encode()]
    run.signal(signal.SIGKILL)
    assert await run.wait() == -signal.SIGKILL
    assert await wait_pids_gone([zygote, *ranks, *children], timeout=10) == []
    assert pids_with_env("FTD_RUN_DIR", str(run.run_dir)) == []


@pytest.mark.skipif(
    not os.path.exists("/dev/nvidiactl"), reason="needs a GPU (CUDA initialised in a forked rank)"
)
async def test_cuda_in_a_forked_rank(serve: ServeFactory, tmp_path: Path) -> None:
    run = await serve(*ZYGOTE, script=TRAPS, script_args=("--out", str(tmp_path), "--cuda"))
    assert await run.wait() == 0
    assert _report(tmp_path, 0)["cuda_sum"] == 8.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preload", "not a module", "x.py"], "preload: 'not a module' is not a module name"),
        (["--start-method", "zygot", "x.py"], "invalid choice: 'zygot'"),
        (
            ["--start-method", "spawn", "--preload", "numpy", "x.py"],
            "preload: only --start-method zygote preloads",
        ),
    ],
)
async def test_bad_zygote_flags(argv: list[str], message: str, tmp_path: Path) -> None:
    (tmp_path / "x.py").write_text("")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "ftd",
        "serve",
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=str(tmp_path),
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        },
    )
    _, stderr = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert message in stderr.decode()
