"""`ftd top` and the event lines of `ftd events`: the picture as a pure function, a plain snapshot
through a pipe, and the live screen under tmux against a real daemon."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from ftd.cli.event_lines import describe_event
from ftd.cli.top import Snapshot, render
from ftd.text import escape
from tests.conftest import BIN, ROOT, Serve, ServeFactory, await_api_event

NOW = time.time()


def _event(id_: int, kind: str, **data: Any) -> dict[str, Any]:
    return {"id": id_, "time": NOW, "kind": kind, "data": data}


RECOVERY = _event(
    9,
    "recovery",
    attempt=1,
    round=1,
    cause="rank 1 exited with exit code 1",
    stages={
        "detect": 0.004,
        "stop": 0.2,
        "rendezvous": 0.9,
        "spawn": 0.1,
        "init": 1.8,
        "restore": None,
        "redo": None,
    },
    total_s=3.004,
    failure_time=NOW - 3,
)


def _snapshot(nodes: int = 3, node_id: str = "node-0") -> Snapshot:
    ranks = [
        {
            "local_rank": i,
            "global_rank": i,
            "pid": 100 + i,
            "state": "running",
            "exit_code": None,
            "last_heartbeat_age_s": 0.25,
            "section": "step",
            "section_age_s": 0.1,
        }
        for i in range(2)
    ]
    status = {
        "node_id": node_id,
        "run_id": "job",
        "state": "running",
        "attempt": 1,
        "round": 1,
        "restart_count": 1,
        "max_restarts": 3,
        "uptime_s": 75.0,
        "ranks": ranks,
        "last_failure": {"kind": "exit", "reason": "rank 1 exited with exit code 1"},
        "policy": {"max_restarts": 3},
        "timeouts": {"rank_heartbeat_timeout": 30.0, "rank_section_timeouts": {"step": 60.0}},
    }
    cluster = {
        "nodes": [
            {"node_id": f"node-{i}", "state": "running", "attempt": 1, "group_rank": i}
            for i in range(nodes)
        ],
        "round": {"round": 1, "members": [f"node-{i}" for i in range(nodes)]},
        "excluded": [{"node_id": "node-2", "reason": "bad"}],
    }
    events = [_event(1, "attempt_started", attempt=0, pids={"0": 100}), RECOVERY]
    return Snapshot(status, cluster, events, RECOVERY)


def test_the_picture_has_nodes_ranks_recovery_and_events() -> None:
    lines = render(_snapshot(), 100, 0, False, 8)
    text = "\n".join(lines)
    assert "\x1b" not in text
    assert all(len(line) <= 100 for line in lines)
    assert "node node-0  run job  RUNNING  attempt 1" in lines[0]
    assert "node-2" in text and "excluded" in text
    rank_row = next(line for line in lines if line.startswith("0 "))
    none = "\u2013"  # no exit code yet
    assert rank_row.split() == [
        "0", "0", "100", "running", none, "250", "ms", "step", "100", "ms", none, none, none, none
    ]  # fmt: skip
    assert "LAST RECOVERY attempt 1: rank 1 exited with exit code 1" in text
    assert "detect 4 ms | stop 200 ms | rendezvous 900 ms | spawn 100 ms | init 1.80 s" in text
    assert "= 3.00 s" in text
    assert "timeouts: rank_heartbeat_timeout=30  rank_section_timeouts=step:60" in text


def test_a_big_cluster_fits_the_terminal() -> None:
    lines = render(_snapshot(nodes=512), 80, 40, True, 5)
    assert len(lines) <= 40
    assert any("more nodes" in line for line in lines)
    plain = [line.replace("\x1b[0m", "") for line in lines]
    assert all(len(line.split("\x1b[")[0]) <= 80 for line in plain)


def test_hostile_data_cannot_drive_the_terminal() -> None:
    evil = "node\x1b]0;pwned\x07\x1b[2J"
    lines = render(_snapshot(node_id=evil), 200, 0, False, 8)
    assert not any("\x1b" in line or "\x07" in line for line in lines)
    assert "node\\x1b]0;pwned\\x07\\x1b[2J" in lines[0]
    line = describe_event(_event(3, "node_lost\x1b[31m", node_id=evil, reason="x" * 500))
    assert "\x1b" not in line and len(line) < 400
    assert escape("a\nb") == "a\\x0ab"


def test_event_lines_show_the_data_that_matters() -> None:
    failed = _event(
        5, "attempt_failed", attempt=0, failure={"kind": "exit", "reason": "rank 1 exited"}
    )
    assert (
        describe_event(failed).split(maxsplit=2)[2] == "attempt_failed     attempt=0 rank 1 exited"
    )
    started = describe_event(_event(6, "attempt_started", attempt=1, pids={"0": 1, "1": 2}))
    assert started.endswith("attempt=1 ranks=2")
    assert describe_event(RECOVERY).endswith("spawn 100 ms | init 1.80 s = 3.00 s")
    assert describe_event({"kind": "odd", "data": None}).split()[:3] == ["?", "??:??:??.???", "odd"]


# -- against a live daemon --------------------------------------------------------------------


async def _start(serve: ServeFactory) -> tuple[Serve, str]:
    run = await serve(
        "--standalone", "--nproc-per-node", "2", "--max-restarts", "3", script=BIN / "dash_rank.py"
    )
    url = (await run.stderr.expect(r"API listening on (http://\S+)"))[1]
    for rank in (0, 1):
        await run.stdout.expect(f"dash rank {rank} attempt 0 up")
    await run.rank_pids(0)  # a forked rank can print before the daemon has its pid
    return run, url


async def _status(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/status") as r:
        status: dict[str, Any] = await r.json()
    return status


async def test_a_plain_snapshot_through_a_pipe(serve: ServeFactory) -> None:
    run, url = await _start(serve)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ftd", "top", "--run-dir", str(run.run_dir),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    text = out.decode()
    assert "\x1b" not in text
    for rank in (await _status(url))["ranks"]:
        assert f"{rank['pid']}" in text
    assert "RANKS of" in text and "attempt_started" in text
    run.signal(signal.SIGTERM)
    await run.wait()


TMUX = shutil.which("tmux")


class Tmux:
    """A private tmux server (its own socket) with one session running a command."""

    def __init__(self, name: str) -> None:
        self.base = ["tmux", "-L", name]

    def __call__(self, *args: str) -> str:
        done = subprocess.run(
            [*self.base, *args], capture_output=True, text=True, timeout=30, check=False
        )
        return done.stdout

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "top")

    async def until(self, condition: Callable[[str], bool], what: str, timeout: float = 60) -> str:
        """The screen once `condition` holds (tmux has no change notification: re-read it)."""
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if condition(screen):
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"the screen never showed {what}:\n{screen}")
            await asyncio.sleep(0.1)


@pytest.mark.skipif(TMUX is None, reason="tmux is missing: apt-get install -y tmux")
async def test_ftd_top_refreshes_in_place_under_tmux(serve: ServeFactory, tmp_path: Path) -> None:
    run, url = await _start(serve)
    tmux = Tmux(f"ftd-test-{os.getpid()}")
    command = f"{sys.executable} -m ftd top --interval 0.3 --run-dir {run.run_dir}"
    env = "env -u COLUMNS -u LINES"  # the pane's size, not the test runner's
    tmux("new-session", "-d", "-s", "top", "-x", "120", "-y", "45", f"{env} {command}")
    try:
        pids = [str(r["pid"]) for r in (await _status(url))["ranks"]]
        first = await tmux.until(
            lambda s: all(pid in s for pid in pids) and "running" in s, "the ranks"
        )
        assert "ftd top  node" in first.splitlines()[0]
        assert all(len(line) <= 120 for line in first.splitlines())

        # heartbeat ages move between refreshes
        def ages(screen: str) -> list[str]:
            rows = [line for line in screen.splitlines() if line.split()[2:3] == [pids[0]]]
            return [re.findall(r"\b\d+(?:\.\d+)? m?s\b", row)[0] for row in rows]

        await tmux.until(lambda s: ages(s) != ages(first), "a new heartbeat age")
        token = (run.run_dir / "api.token").read_text().strip()
        async with aiohttp.ClientSession() as session:
            headers = {"Authorization": f"Bearer {token}"}
            body = {"reason": "from the top test", "count": False}
            async with session.post(f"{url}/v1/restart", json=body, headers=headers) as r:
                assert r.status == 202
        for rank in (0, 1):
            await run.stdout.expect(f"dash rank {rank} attempt 1 up")
        # A forked rank can print before the daemon has its pid: the status has every new pid
        # once the attempt_started event is out.
        await await_api_event(url, "attempt_started", attempt=1)
        new_pids = [str(r["pid"]) for r in (await _status(url))["ranks"]]
        screen = await tmux.until(
            lambda s: all(pid in s for pid in new_pids) and "attempt=1 ranks=2" in s,
            "the restart",
        )
        assert "from the top test" in screen
        (tmp_path / "screen.txt").write_text(screen)
        tmux("send-keys", "-t", "top", "q")
        await tmux.until(lambda s: "ftd top" not in s, "the screen restored")
    finally:
        tmux("kill-server")
    run.signal(signal.SIGTERM)
    await run.wait()
