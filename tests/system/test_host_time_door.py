"""`host_us` in a rank's progress report, on a live daemon: a rank that sends it negative,
fractional, beyond 2**53, a boolean, text, a list or an object has each report refused at the
door and counted (`bad_progress`), as `fwd_us`'s; the valid one passes; the daemon goes on.
Before the field was one of protocol.PROGRESS_COUNTS every one of them passed the decoder."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BIN, ServeFactory
from tests.support.api import api_of

HOST_TIME_RANK = BIN / "host_time_rank.py"
HOSTILE_REPORTS = 7

pytestmark = pytest.mark.timeout(240)


async def test_hostile_host_times_are_refused_and_counted(
    serve: ServeFactory, tmp_path: Path
) -> None:
    out = tmp_path / "rank"
    flags = ("--nproc-per-node", "1", "--max-restarts", "0", "--preload", "none")
    run = await serve(*flags, script=HOST_TIME_RANK, script_args=("--out", str(out)))
    sent = out / "sent.json"
    while not sent.exists():  # the rank writes it once every report is on the socket
        assert run.proc.returncode is None, run.stderr.text[-3000:]
        await asyncio.sleep(0.05)
    assert json.loads(sent.read_text()) == {"sent": 1 + HOSTILE_REPORTS}
    dropped: dict[str, Any] = {}
    async with api_of(run) as api:
        for _ in range(400):  # reports may still be queued behind the rank's first ones
            code, status, _ = await api.call("GET", "/v1/status")
            assert code == 200, status
            dropped = status["ipc"]["dropped"]
            if dropped.get("bad_progress", 0) >= HOSTILE_REPORTS:
                break
            await asyncio.sleep(0.05)
    assert dropped == {"bad_progress": HOSTILE_REPORTS}, dropped
    (out / "release").touch()
    assert await run.wait() == 0
    assert "Traceback (most recent call last)" not in run.stderr.text, run.stderr.text[-3000:]
    assert "internal error" not in run.stderr.text, run.stderr.text[-3000:]
