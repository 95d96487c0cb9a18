"""A standby on its board: the status's `standby` field, the `standby` and `standby_ended`
events, what `ftd status` prints of it; cleared by the round it joins or the job's end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ftd.cli.status_view import format_status
from ftd.config.serve import ServeConfig
from ftd.status.board import StatusBoard
from ftd.status.event_kind import EventKind
from ftd.status.events import EventLog
from ftd.status.model import DaemonState, NodeStatus, Standby
from ftd.status.persist import Persistence

REASON = "standby: round 4 is full (2 nodes), waiting to take a lost node's place"


class NoProgress:
    def node_view(self) -> dict[str, Any]:
        return {}

    def deadlines_view(self) -> dict[str, Any]:
        return {}


class NoLiveView:
    progress = NoProgress()

    def snapshot(self, pid: int | None) -> dict[str, Any] | None:
        return None

    def timeouts_view(self) -> dict[str, Any]:
        return {}

    def ipc_view(self) -> dict[str, Any]:
        return {}


def _board(run_dir: Path) -> tuple[StatusBoard, EventLog, list[dict[str, Any]]]:
    config = ServeConfig(entrypoint=__file__, node_id="c", run_id="job")
    events = EventLog(run_dir / "events.jsonl")
    published: list[dict[str, Any]] = []
    status = NodeStatus(node_id="c", run_id="job", state=DaemonState.RENDEZVOUS)
    board = StatusBoard(
        config, status, events, Persistence(), run_dir, NoLiveView(), published.append
    )
    return board, events, published


def _written(run_dir: Path) -> dict[str, Any]:
    status: dict[str, Any] = json.loads((run_dir / "status.json").read_text())
    return status


def test_a_standby_until_it_joins_a_round(tmp_path: Path) -> None:
    board, events, published = _board(tmp_path)
    board.standby(Standby(round=4, members=2, since=1000.0))
    board.standby(Standby(round=4, members=2, since=1001.0))  # the same wait: said once
    written = _written(tmp_path)
    assert written["standby"] == {"round": 4, "members": 2, "since": 1000.0, "reason": REASON}
    assert len(published) == 1
    board.round_joined(5, 1, 0)
    assert _written(tmp_path)["standby"] is None
    said = [(e.kind, e.data) for e in events.since(0)]
    assert said[0] == (EventKind.STANDBY, {"round": 4, "members": 2, "reason": REASON})
    kind, data = said[1]
    assert kind == EventKind.STANDBY_ENDED and data["round"] == 4
    assert data["reason"] == "joined round 5 as an active node (node rank 1)"
    board.round_joined(6, 1, 0)  # no longer a standby: nothing more to say
    assert len(events.since(0)) == 2


def test_a_standby_whose_job_ends_is_one_no_more(tmp_path: Path) -> None:
    board, events, _ = _board(tmp_path)
    board.standby(Standby(round=0, members=2, since=1000.0))
    board.set_state(DaemonState.RENDEZVOUS, "joining the next round")  # still waiting
    assert _written(tmp_path)["standby"] is not None
    board.set_state(DaemonState.SUCCEEDED, "every node's ranks exited 0")
    assert board.status.standby is None and _written(tmp_path)["standby"] is None
    [ended] = [e for e in events.since(0) if e.kind == EventKind.STANDBY_ENDED]
    assert ended.data["reason"] == "the daemon is succeeded: every node's ranks exited 0"


def test_ftd_status_says_it_in_one_line(tmp_path: Path) -> None:
    board, _, _ = _board(tmp_path)
    board.standby(Standby(round=4, members=2, since=1000.0))
    cluster = {
        "round": {"round": 4, "members": ["a", "b"]},
        "nodes": [
            {"node_id": "a", "state": "running", "role": "active"},
            {"node_id": "c", "state": "rendezvous", "role": "standby"},
        ],
        "excluded": [],
    }
    text = format_status(_written(tmp_path), cluster)
    [line] = [line for line in text.splitlines() if line.startswith("standby:")]
    assert line.startswith(REASON + " (since ")
    [row] = [line for line in text.splitlines() if line.startswith("c ")]
    assert row.split()[-1] == "standby"
