"""The culprit signal, from two real gloo ranks (tests/bin/progress_rank.py): the rank that
stops entering collectives has entered fewer than the rank blocked in the next one, and the
blocked rank's sampler goes on reporting while its main thread waits inside gloo."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BIN, ROOT

STOP_AT = 5
DEADLINE_S = 120.0
REPORTS_WHILE_BLOCKED = 5


Start = Callable[[str], "queue.Queue[Any]"]


@pytest.fixture
def start_ranks(tmp_path: Path) -> Iterator[Start]:
    """Start both ranks, blocked in `ddp` or `python`; their records (None: a rank exited)."""
    procs: list[subprocess.Popen[str]] = []
    pumps: list[threading.Thread] = []
    records: queue.Queue[Any] = queue.Queue()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'client'}", "OMP_NUM_THREADS": "1"}

    def pump(proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            records.put(json.loads(line))
        records.put(None)

    def start(blocked_in: str) -> queue.Queue[Any]:
        for rank in (0, 1):
            command = [sys.executable, str(BIN / "progress_rank.py"), str(rank)]
            command += ["--init-file", str(tmp_path / "init"), "--stop-at", str(STOP_AT)]
            with (tmp_path / f"rank{rank}.err").open("w") as stderr:
                proc = subprocess.Popen(
                    [*command, "--blocked-in", blocked_in],
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    env=env,
                    text=True,
                )
            procs.append(proc)
            pumps.append(threading.Thread(target=pump, args=(proc,), daemon=True))
            pumps[-1].start()
        return records

    try:
        yield start
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        for thread in pumps:
            thread.join(30)  # EOF once the rank is gone
        for proc in procs:
            assert proc.stdout is not None
            proc.stdout.close()


@pytest.mark.parametrize("blocked_in", ["ddp", "python"])
def test_the_stopped_rank_has_entered_fewer_collectives(
    start_ranks: Start, blocked_in: str
) -> None:
    records = start_ranks(blocked_in)
    latest: dict[int, dict[str, Any]] = {}
    blocked_reports = 0
    deadline = time.monotonic() + DEADLINE_S
    while blocked_reports < REPORTS_WHILE_BLOCKED:
        record = records.get(timeout=max(deadline - time.monotonic(), 0.1))
        assert record is not None, "a rank exited"
        latest[record["rank"]] = record
        if len(latest) < 2 or any(r["steps"] < STOP_AT for r in latest.values()):
            continue
        if latest[0].get("entered", 0) > latest[1].get("entered", 0) and record["rank"] == 0:
            blocked_reports += 1  # rank 0 is inside the collective; its sampler still reports
    first, stopped = latest[0], latest[1]
    assert first["steps"] == stopped["steps"] == STOP_AT
    assert stopped["called"] == stopped["returned"]
    # A Python call in progress shows; DDP's allreduce from C++ only in the entered count.
    assert first["called"] - first["returned"] == (1 if blocked_in == "python" else 0)
