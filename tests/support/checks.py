"""What a test of a live daemon may owe besides its own point (the chaos suite's checks): the
daemon did not crash or lose an error, nothing the job started outlived it; and reading its API
and metrics."""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from tests.conftest import Serve, event_lines, pids_with_env, wait_pids_gone

AS_ROOT = os.geteuid() == 0
DAEMON_SLIPS = (
    "exception was never retrieved",
    "Task exception",
    "background task",
    "teardown gave up",
    "error while ",
    "an exit listener failed",
)
"""What the daemon says when an error of its own escaped (besides a traceback)."""


def exceptions_in(text: str) -> list[str]:
    """The last line of every traceback in `text`: the exception it ended with."""
    found, inside = [], False
    for line in text.splitlines():
        if line.startswith("Traceback (most recent call last)"):
            inside = True
        elif inside and line and not line.startswith(" "):
            found.append(line)
            inside = False
    return found


def assert_sound(run: Serve, run_dir: Path | None = None) -> None:
    """The daemon crashed nowhere, lost no error, tore no event line, left no temporary file.
    (No test here lets a rank print a traceback of its own to the daemon's stderr unprefixed,
    so every traceback there is the daemon's, but for those the failure summary quotes.)
    `run_dir`: a node's own, on several nodes."""
    stderr = run.stderr.text
    slips = [line for line in stderr.splitlines() if any(mark in line for mark in DAEMON_SLIPS)]
    assert not slips, f"the daemon slipped: {slips}"
    tracebacks = exceptions_in(stderr.split("restarts exhausted, the job failed:")[0])
    assert not tracebacks, f"tracebacks: {tracebacks}\n{stderr[-4000:]}"
    run_dir = run_dir or run.run_dir
    event_lines(run_dir)
    leftovers = sorted(p.name for p in run_dir.glob(".*.tmp"))
    assert not leftovers, f"temporary files left behind: {leftovers}"


async def assert_no_orphans(run_dir: Path, timeout: float = 30.0) -> None:
    """Nothing the job started outlives the daemon (the ranks carry FTD_RUN_DIR, and so do
    their children)."""
    pids = pids_with_env("FTD_RUN_DIR", str(run_dir))
    assert await wait_pids_gone(pids, timeout) == []


@contextlib.asynccontextmanager
async def api_session(run: Serve) -> AsyncIterator[tuple[aiohttp.ClientSession, str, str]]:
    """(session, base URL, token) of a running daemon's API, once it listens."""
    await run.stderr.expect(r"API listening on ", timeout=60)
    info = json.loads((run.run_dir / "api.json").read_text())
    token = Path(info["token_file"]).read_text().strip()
    async with aiohttp.ClientSession() as session:
        yield session, info["url"], token


def metric(text: str, name: str, **labels: str) -> float:
    selector = ",".join(f'{key}="{value}"' for key, value in labels.items())
    match = re.search(rf"^{name}\{{{re.escape(selector)}\}} (\S+)$", text, re.MULTILINE)
    return float(match[1]) if match else 0.0
