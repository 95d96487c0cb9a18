"""Issue 44 items 1 and 7: the root cause of a failure survives the job's end. A rank's
exception (from its error file) or its last stderr lines (an interpreter that died before any
error file existed) is the status' `last_failure.cause`: in status.json, the events, `ftd status`
live and `--run-dir`, `ftd events` and the failure summary; without captured output the summary
says where the error went instead of a dead end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftd.status.model import Failure
from ftd.supervision.summary import NO_ERROR_FILE, failure_cause, failure_summary
from tests.cli.test_cli_truth import ftd
from tests.conftest import BIN, ServeFactory, events_in

MISSING_FILE_RANK = BIN / "missing_file_rank.py"
MISSING = "/nonexistent/ftd-issue-44/data.bin"
EXCEPTION = f"FileNotFoundError: [Errno 2] No such file or directory: '{MISSING}'"
NO_MODULE = "No module named no_such_module_44"


def _exit_failure(error_file: Path) -> Failure:
    return Failure(
        kind="exit",
        reason="rank 0 (local 0, pid 7) failed with exit code 1",
        local_rank=0,
        global_rank=0,
        pid=7,
        exit_code=1,
        error_file=str(error_file),
        timestamp=1.0e9,
    )


def test_the_cause_is_the_error_files_exception_else_stderr_else_where_it_went(
    tmp_path: Path,
) -> None:
    rank_dir = tmp_path / "attempt_0" / "0"
    rank_dir.mkdir(parents=True)
    error_file = rank_dir / "error.json"
    failure = _exit_failure(error_file)
    assert failure_cause(failure) == NO_ERROR_FILE  # no file, no captured output
    summary = failure_summary("train.py", failure, [], {})
    assert NO_ERROR_FILE in summary and "To enable traceback" not in summary

    (rank_dir / "stderr.log").write_text(f"noise\n/usr/bin/python: {NO_MODULE}\x1b[2J\n")
    cause = failure_cause(failure)
    assert cause is not None and cause.endswith(f"{NO_MODULE}\\x1b[2J")  # escaped
    assert NO_MODULE in failure_summary("train.py", failure, [], {})

    error_file.write_text(json.dumps({"message": EXCEPTION, "timestamp": 1000000000}))
    assert failure_cause(failure) == EXCEPTION
    huge = "E: " + "x" * 10_000
    error_file.write_text(json.dumps({"message": huge, "timestamp": 1000000000}))
    cause = failure_cause(failure)
    assert cause is not None and len(cause) <= 2001

    assert failure_cause(Failure(kind="hang", reason="rank 0 hung")) is None
    shown = failure.to_dict()
    assert "cause" in shown


async def test_a_job_that_fails_for_good_names_its_exception_everywhere(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """The done-when of item 1: a script that opens a missing file, --max-restarts 1."""
    gate = tmp_path / "gate"
    run = await serve(
        "--standalone",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "1",
        script=MISSING_FILE_RANK,
        script_args=(str(gate),),
    )
    where = ("--run-dir", str(run.run_dir))
    await run.stdout.expect("missing-file rank attempt 0 up")
    Path(f"{gate}.0").touch()
    await run.stdout.expect("missing-file rank attempt 1 up")
    code, out, err = await ftd("status", *where)  # live: the daemon answers
    assert code == 0, err
    assert f"cause: {EXCEPTION}" in out.splitlines(), out

    Path(f"{gate}.1").touch()
    assert await run.wait() == 1
    summary = run.stderr.text[run.stderr.text.rindex("restarts exhausted") :]
    assert "FileNotFoundError" in summary and MISSING in summary, summary

    status = json.loads((run.run_dir / "status.json").read_text())
    assert status["state"] == "failed" and status["last_failure"]["cause"] == EXCEPTION
    failed = events_in(run.run_dir, "attempt_failed")
    assert [event["data"]["failure"]["cause"] for event in failed] == [EXCEPTION] * 2

    code, out, err = await ftd("status", *where)  # final: read from the run directory
    assert code == 0, err
    assert "state failed (final)" in out and f"cause: {EXCEPTION}" in out.splitlines(), out
    code, out, err = await ftd("events", *where)
    assert code == 0, err
    assert f"cause={EXCEPTION}" in out, out


async def test_a_missing_module_names_its_error_in_the_summary(serve: ServeFactory) -> None:
    """Item 7: `-m missing_module` dies in the interpreter before torch's error file exists:
    without -r/-t the summary says the error is in the output above; with -r 2 it shows it."""
    run = await serve(
        "--standalone",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        "-m",
        script="no_such_module_44",
    )
    assert await run.wait() == 1
    text = run.stderr.text
    summary = text[text.rindex("the job failed") :]
    assert NO_ERROR_FILE in summary and "To enable traceback" not in summary, summary
    assert NO_MODULE in text[: text.rindex("the job failed")]  # the output above it

    captured = await serve(
        "--standalone",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        "-r",
        "2",
        "-m",
        script="no_such_module_44",
        run_id="captured",
    )
    assert await captured.wait() == 1
    text = captured.stderr.text
    summary = text[text.rindex("the job failed") :]
    assert NO_MODULE in summary.split("traceback :", 1)[1], summary
    code, out, err = await ftd("status", "--run-dir", str(captured.run_dir))
    assert code == 0, err
    assert any(line.startswith("cause: ") and NO_MODULE in line for line in out.splitlines())


@pytest.mark.parametrize("kind", ["escapes", "huge", "fifo"])
async def test_a_hostile_error_file_gives_a_bounded_escaped_cause(
    serve: ServeFactory, kind: str
) -> None:
    """Attack: a rank's error file with terminal escapes, 10 MB of brackets or a FIFO. The
    cause is escaped, bounded, never a wait on the FIFO; status.json and `ftd status` carry
    no raw control character."""
    run = await serve(
        *("--standalone", "--nproc-per-node", "1", "--max-restarts", "0", "-r", "2"),
        script=BIN / "bad_error_file.py",
        script_args=("--kind", kind),
    )
    assert await run.wait() == 1
    cause = json.loads((run.run_dir / "status.json").read_text())["last_failure"]["cause"]
    assert isinstance(cause, str) and 0 < len(cause) <= 2001, cause[:200]
    assert "\x1b" not in cause and "\u202e" not in cause
    if kind == "escapes":
        assert cause.startswith("RuntimeError: \\x1b[2J")
    else:  # the stderr tail, or the refusal when the tail is still in the pipe
        assert f"rank wrote a {kind} error file" in cause or cause.startswith(
            "error file unreadable: "
        ), cause
    code, out, err = await ftd("status", "--run-dir", str(run.run_dir))
    assert code == 0, err
    assert "\x1b" not in out and "\u202e" not in out
    assert any(line.startswith("cause: ") for line in out.splitlines()), out
