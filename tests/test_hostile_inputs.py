"""Hostile input on live daemons (issue 23 rows 2, 9, 10, 11): error files, terminal escapes,
scheduler variables and a rendezvous endpoint where no store listens. Each ends with one line
and the right exit code, never a traceback of ftd's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import BIN, ROOT, WORKER, ServeFactory

BAD_ERROR_FILE = BIN / "bad_error_file.py"


def no_ftd_traceback(text: str) -> None:
    assert "Traceback (most recent call last)" not in text.replace("Traceback ...", ""), text[
        -3000:
    ]
    assert "JSONDecodeError" not in text


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("empty", "empty"),
        ("truncated", "not JSON"),
        ("not_json", "not JSON"),
        ("huge", "larger than 256 KiB"),
        ("fifo", "not a regular file"),
    ],
)
async def test_r02_an_unreadable_error_file_is_named_in_the_summary(
    serve: ServeFactory, kind: str, reason: str
) -> None:
    run = await serve(
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        script=BAD_ERROR_FILE,
        script_args=("--kind", kind),
    )
    assert await run.wait() == 1
    text = run.stderr.text
    summary = text[text.index("restarts exhausted") :]
    assert "Root Cause (first observed failure)" in summary
    assert "exitcode  : 1" in summary
    assert f"error file unreadable: {reason}" in summary, summary
    assert str(run.attempt_dir(0) / "0" / "error.json") in summary
    no_ftd_traceback(text)


async def test_r09_escapes_in_an_error_file_are_shown_escaped(serve: ServeFactory) -> None:
    run = await serve(
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        script=BAD_ERROR_FILE,
        script_args=("--kind", "escapes"),
    )
    assert await run.wait() == 1
    summary = run.stderr.text[run.stderr.text.index("restarts exhausted") :]
    assert "RuntimeError: \\x1b[2J\\x1b]0;pwned\\x07 \\u202egnp.exe" in summary, summary
    assert "\x1b" not in summary and "\u202e" not in summary and "\x07" not in summary


@pytest.mark.parametrize(
    "nodelist",
    ["n" + "[1]" * 1300, "n" + "[" * 2000 + "1" + "]" * 2000, "n[0-999999999],m[1-9]" * 100],
)
def test_r10_a_hostile_slurm_nodelist_is_one_line_and_exit_2(tmp_path: Path, nodelist: str) -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": f"{ROOT}:{ROOT / 'client'}",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": nodelist,
    }
    proc = subprocess.run(
        [sys.executable, "-m", "ftd", "serve", str(WORKER)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ftd serve: error: SLURM_JOB_NODELIST: "), lines
    assert len(lines[0]) < 300
    assert list(tmp_path.iterdir()) == []
