"""The node's and the ranks' progress in `ftd top` and `ftd status` (ftd/cli/status_view.py):
steps and step time per rank, the node's steps/s and time lost, job text escaped."""

from __future__ import annotations

import time
from typing import Any

from ftd.cli.status_view import RANK_HEADER, format_status, progress_text
from ftd.cli.top import Snapshot, render
from ftd.text import NO_VALUE

SINCE = time.time() - 600


def _status(progress: Any, rank_progress: Any) -> dict[str, Any]:
    ranks = [
        {
            "local_rank": i,
            "global_rank": i,
            "pid": 100 + i,
            "state": "running",
            "exit_code": None,
            "last_heartbeat_age_s": None,
            "section": None,
            "section_age_s": None,
            "progress": rank_progress,
        }
        for i in range(2)
    ]
    return {
        "node_id": "node-0",
        "run_id": "job",
        "state": "running",
        "attempt": 1,
        "restart_count": 1,
        "max_restarts": 3,
        "ranks": ranks,
        "last_failure": None,
        "progress": progress,
    }


NODE = {
    "steps": 1200,
    "steps_per_s": 3.2149,
    "making_steps_s": 374.0,
    "time_lost_s": 41.23,
    "since": SINCE,
}
RANK = {"steps": 1201, "step_time_s": 0.3105, "collectives_entered": 2402, "progress_age_s": 0.1}


def test_top_and_status_show_steps_step_time_pace_and_time_lost() -> None:
    status = _status(NODE, RANK)
    clock = time.strftime("%H:%M:%S", time.localtime(SINCE))
    line = (
        f"progress: 1200 steps, 3.21 steps/s, making steps 6 min 14 s, time lost 41.2 s "
        f"since {clock}"
    )
    assert progress_text(status) == line
    screen = render(Snapshot(status, {}, []), 140, 0, False, 0)
    assert line in screen
    header = next(row for row in screen if row.startswith("LOCAL"))
    assert header.split()[-4:] == ["STEPS", "STEP", "TIME", "STRAGGLER"]
    assert RANK_HEADER[-3] == "STEPS"
    rows = screen[screen.index(header) + 1 : screen.index(header) + 3]
    assert all(row.split()[-4:] == ["1201", "311", "ms", NO_VALUE] for row in rows), rows
    text = format_status(status, {}).splitlines()
    assert line in text


def test_no_progress_is_dashes_and_hostile_values_are_escaped() -> None:
    status = _status(None, None)
    assert progress_text(status) == ""
    screen = render(Snapshot(status, {}, []), 140, 0, False, 0)
    assert not any(row.startswith("progress:") for row in screen)
    header = next(i for i, row in enumerate(screen) if row.startswith("LOCAL"))
    assert screen[header + 1].split()[-3:] == [NO_VALUE, NO_VALUE, NO_VALUE]
    evil = {**NODE, "steps": "\x1b]0;owned\x07", "steps_per_s": "fast", "time_lost_s": True}
    hostile = _status(evil, {"steps": "\x1b[2J", "step_time_s": "slow"})
    line = progress_text(hostile)
    assert "\x1b" not in line and "\\x1b]0;owned\\x07 steps" in line
    assert f"{NO_VALUE} steps/s" in line and f"time lost {NO_VALUE}" in line
    screen = render(Snapshot(hostile, {}, []), 140, 0, False, 0)
    assert not any("\x1b" in row or "\x07" in row for row in screen)
    header = next(i for i, row in enumerate(screen) if row.startswith("LOCAL"))
    assert screen[header + 1].split()[-3:] == [NO_VALUE, NO_VALUE, NO_VALUE]
