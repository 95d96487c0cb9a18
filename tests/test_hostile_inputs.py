"""Hostile input on live daemons (issue 23 rows 2, 9, 10, 11): error files, terminal escapes,
scheduler variables and a rendezvous endpoint where no store listens. Each ends with one line
and the right exit code, never a traceback of ftd's."""

from __future__ import annotations

import pytest

from tests.conftest import BIN, ServeFactory

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
