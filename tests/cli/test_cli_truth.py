"""Issue 27, the command line's side: `ftd status`, `ftd top`, `ftd events` and the failure
summary tell the truth after a failure, during a back-off and on a finished run (rows 2, 5, 6,
7, 9, 10 and 13 of the issue's table)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftd.cli.event_lines import describe_event, stages_text
from ftd.cli.status_view import format_status
from ftd.cli.top import Snapshot, render
from ftd.status.model import NodeStatus
from ftd.supervision.summary import ending_headline, failure_summary, rank_failure
from ftd.text import NO_VALUE, duration
from tests.conftest import BIN, ROOT, ServeFactory, events_in


async def ftd(*args: str) -> tuple[int, str, str]:
    """`ftd ARGS...` as an operator runs it: exit status, stdout, stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ftd", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL, cwd=ROOT,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def _status(**changes: Any) -> dict[str, Any]:
    """A status as `GET /v1/status` answers it (recorded from a standalone daemon)."""
    status: dict[str, Any] = {
        "node_id": "vm",
        "run_id": "job",
        "state": "running",
        "attempt": 3,
        "round": 3,
        "restart_count": 2,
        "max_restarts": 3,
        "restart_policy": "any-failed",
        "timeouts": {
            "initial_rank_heartbeat_timeout": None,
            "rank_heartbeat_timeout": 30.0,
            "rank_section_timeouts": {"step": 60.0, "setup": None},
            "rank_out_of_section_timeout": None,
        },
        "ranks": [
            {
                "local_rank": 0,
                "global_rank": 0,
                "pid": 4242,
                "state": "running",
                "exit_code": None,
                "last_heartbeat_age_s": 0.9996,
                "section": None,
                "section_age_s": None,
            }
        ],
        "last_failure": None,
        "last_recovery": None,
        "backoff_s": 0.0,
        "backoff_left_s": None,
        "fast_failures": 0,
        "pid": 999,
        "uptime_s": 86400.0,
        "policy": {"restart_policy": "any-failed", "max_restarts": 3, "restarts_left": 1},
    }
    status.update(changes)
    return status


CLUSTER: dict[str, Any] = {
    "round": {"round": 3, "members": ["vm"]},
    "nodes": [{"node_id": "vm", "state": "running", "attempt": 3, "restart_count": 2}],
    "excluded": [],
}


def _snapshot(status: dict[str, Any], cluster: dict[str, Any] = CLUSTER) -> Snapshot:
    return Snapshot(status, cluster, [], None)


# -- row 5: one duration formatter ------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (None, NO_VALUE),
        (float("nan"), NO_VALUE),
        (True, NO_VALUE),
        (0, "0 ms"),
        (0.0004, "<1 ms"),
        (0.004, "4 ms"),
        (0.9994, "999 ms"),
        (0.9996, "1.00 s"),
        (9.996, "10.0 s"),
        (59.9996, "1 min 0 s"),
        (119.6, "2 min 0 s"),
        (3599.6, "1 h 0 min"),
        (86400, "1 d 0 h"),
        (86399.9, "1 d 0 h"),
        (-1.5, "-1.50 s"),
        (1e300, ">99999 d"),
    ],
)
def test_durations_carry_into_the_next_unit(seconds: object, shown: str) -> None:
    assert duration(seconds) == shown


_NO_FULL_UNIT = re.compile(r"(?<![\d.])(1000 ms|60 s|60 min|24 h)\b")
_PARTS = re.compile(r"([\d.]+) (ms|s|min|h|d)")
_UNIT_S = {"ms": 0.001, "s": 1, "min": 60, "h": 3600, "d": 86400}


@given(st.floats(min_value=0, max_value=8e9, allow_nan=False))
def test_a_carry_never_shows_a_full_unit(seconds: float) -> None:
    shown = duration(seconds)
    assert not _NO_FULL_UNIT.search(shown), shown
    if shown == "<1 ms":
        assert 0 < seconds < 0.0005
        return
    back = sum(float(n) * _UNIT_S[unit] for n, unit in _PARTS.findall(shown))
    # each form is exact to half its last digit (1 ms, 0.01 s, 0.1 s, 1 s, 1 min, 1 h)
    assert abs(back - seconds) <= max(0.0005, seconds * 0.02, 0.5 if seconds >= 60 else 0), shown


def test_every_cli_surface_uses_the_one_formatter() -> None:
    assert stages_text({"stages": {"detect": 0.9996}, "total_s": 59.9996}) == (
        "detect 1.00 s = 1 min 0 s"
    )
    backoff = {"id": 1, "time": 0, "kind": "restart_backoff", "data": {"delay_s": 86400}}
    assert "delay_s=1 d 0 h" in describe_event(backoff)
    lost = {"id": 2, "time": 0, "kind": "messages_lost", "data": {"rate_per_s": 12.5}}
    assert "rate_per_s=12.5" in describe_event(lost)  # a rate, not a duration
    top = "\n".join(render(_snapshot(_status()), 0, 0, False, 0))
    assert "uptime 1 d 0 h" in top and "1.00 s" in top
    assert "1.00 s" in format_status(_status(), CLUSTER)


# -- row 2: a finished run's status and events -----------------------------------------------


async def test_status_and_events_of_a_finished_run(serve: ServeFactory) -> None:
    run = await serve(
        "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
        script_args=("--fail-attempts", "1", "--fail-mode", "exit:3", "--fail-rank", "0"),
    )  # fmt: skip
    assert await run.wait() == 1
    where = ("--run-dir", str(run.run_dir))

    code, out, err = await ftd("status", *where)
    assert code == 0, err
    lines = out.splitlines()
    assert "state failed (final)" in lines[0]
    assert lines[1].startswith("the job failed at ") and "(its daemon stopped)" in lines[1]
    assert "failed with exit code 3; no restarts left (0/0 used)" in lines[1]
    assert "status.json" in err and "None" not in out

    code, out, err = await ftd("status", "--json", *where)
    assert code == 0, err
    document = json.loads(out)
    assert document["final"] is True and document["ending"]["state"] == "failed"

    code, out, err = await ftd("events", *where)
    assert code == 0, err
    assert "daemon_stopped     state=failed" in out.splitlines()[-1]

    code, out, err = await ftd("top", *where)
    assert code == 0, err
    assert "FAILED (final)" in out.splitlines()[0] and "exit code 3" in out


async def test_a_run_dir_that_is_no_run_is_a_one_line_error(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    for command in ("status", "events", "top"):
        code, out, err = await ftd(command, "--run-dir", str(missing))
        assert code == 2 and out == "", (command, err)
        assert err.count("\n") <= 2 and "error:" in err and "Traceback" not in err

    bad = tmp_path / "bad"
    bad.mkdir(mode=0o700)
    (bad / "status.json").write_text('{"state": "fail')
    code, _, err = await ftd("status", "--run-dir", str(bad))
    assert code == 2 and "status.json is not JSON" in err and err.count("\n") == 1

    (bad / "status.json").write_text("[1, 2]")
    code, _, err = await ftd("status", "--run-dir", str(bad))
    assert code == 2 and "not an ftd status" in err

    (bad / "status.json").write_text(" " * (5 * 1024 * 1024))
    code, _, err = await ftd("status", "--run-dir", str(bad))
    assert code == 2 and "larger than" in err

    (bad / "status.json").unlink()
    os.mkfifo(bad / "events.jsonl")  # must not block the reader
    code, _, err = await ftd("events", "--run-dir", str(bad))
    assert code == 2 and "not a regular file" in err

    (bad / "events.jsonl").unlink()
    good = {"id": 2, "time": time.time(), "kind": "daemon_stopped", "data": {"state": "failed"}}
    with (bad / "events.jsonl").open("w") as lines:
        lines.write("x" * (2 * 1024 * 1024) + "\n")  # an over-long line
        lines.write("not json\n[]\n")
        lines.write(json.dumps(good) + "\n")
    code, out, err = await ftd("events", "--run-dir", str(bad))
    assert code == 0 and "daemon_stopped" in out and "skipped 3 malformed lines" in err


# -- row 6: the back-off shows as a countdown -------------------------------------------------


def test_the_back_off_is_a_countdown_in_status_and_top() -> None:
    status = _status(state="restarting", backoff_s=4.0, backoff_left_s=3.2, fast_failures=3)
    line = "restarting in 3.20 s (back-off after 3 fast failures in a row"
    assert line in format_status(status, CLUSTER)
    assert line in "\n".join(render(_snapshot(status), 200, 0, False, 0))
    over = _status(state="rendezvous", backoff_s=4.0, backoff_left_s=0.0, fast_failures=3)
    assert "restarting in" not in format_status(over, CLUSTER)

    node = NodeStatus("vm", "job", backoff_s=5.0, backoff_until=time.time() + 5, fast_failures=2)
    shown = node.to_dict()
    assert 0 < shown["backoff_left_s"] <= 5 and shown["fast_failures"] == 2  # type: ignore[operator]


async def test_a_live_back_off_and_a_timeouts_change(serve: ServeFactory) -> None:
    run = await serve(
        "--standalone", "--nproc-per-node", "1", "--max-restarts", "5",
        "--restart-backoff", "60:60",
        script_args=("--fail-attempts", "9", "--fail-mode", "exit:3"),
    )  # fmt: skip
    # The second fast failure in a row earns the wait (the first restart is immediate).
    await run.stderr.expect(r"waiting 60\.0s before the next \(--restart-backoff\)")
    where = ("--run-dir", str(run.run_dir))
    code, out, err = await ftd("status", *where)
    assert code == 0, err
    assert re.search(r"restarting in \d+\.\d s \(back-off after 2 fast failures in a row", out)
    code, out, err = await ftd("top", "--once", *where)
    assert code == 0, err
    assert "restarting in " in out

    # row 9: a change of timeouts shows before and after
    code, _, err = await ftd("timeouts", "set", "rank_heartbeat_timeout=30", *where)
    assert code == 0, err
    [change] = events_in(run.run_dir, "timeouts_changed")
    assert change["data"]["previous"]["rank_heartbeat_timeout"] is None
    code, out, err = await ftd("events", *where)
    assert code == 0, err
    assert "rank_heartbeat_timeout=off→30" in out
    run.signal(signal.SIGTERM)
    await run.wait()


# -- row 7: restarts counted one way; the summary's true time --------------------------------


def test_restarts_are_one_labelled_count_everywhere() -> None:
    status = _status()
    cluster = {**CLUSTER, "nodes": [{**CLUSTER["nodes"][0]}]}  # no max_restarts of its own
    text = format_status(status, cluster)
    assert "restarts 2/3 used" in text.splitlines()[0]
    assert re.search(r"^vm\s+running\s+3\s+2/3\b", text, re.M)
    assert "restarts 2/3 used" in render(_snapshot(status, cluster), 200, 0, False, 0)[0]


def test_the_summary_shows_when_the_rank_failed(tmp_path: Path) -> None:
    recorded = 1_795_668_413
    error_file = tmp_path / "error.json"
    message = {"message": "RuntimeError: boom", "extraInfo": {"timestamp": str(recorded)}}
    error_file.write_text(json.dumps({"message": message}))
    os.utime(error_file, (recorded + 0.879, recorded + 0.879))
    failure = rank_failure(0, 0, 41, 1, str(error_file), exited_at=recorded + 1.06)
    assert failure.timestamp == pytest.approx(recorded + 0.879)
    # No error file: when the daemon saw the exit, not when the summary was written.
    silent = rank_failure(1, 1, 42, 3, str(tmp_path / "none.json"), exited_at=recorded + 2.5)
    assert silent.timestamp == recorded + 2.5

    from ftd.status.model import Failure

    root = Failure(
        kind="exit", reason="rank 0 failed", local_rank=0, global_rank=0, pid=41, exit_code=1,
        error_file=str(error_file), timestamp=recorded + 1.06,
    )  # fmt: skip
    summary = failure_summary("train.py", root, [], {})
    shown = time.strftime("%H:%M:%S", time.localtime(recorded)) + ".879"
    assert f"time      : {time.strftime('%Y-%m-%d', time.localtime(recorded))}_{shown}" in summary


# -- row 9: one-line events keep the stacks path visible -------------------------------------

STACKS = "/var/log/ftd/some-long-run-id/attempt_3/1/stacks.txt"
HUNG_REASON = "rank 1 sent no heartbeat within rank_heartbeat_timeout (30s) " + "x" * 300


def test_hangs_and_failures_keep_the_stacks_path() -> None:
    hung = {
        "id": 7,
        "time": time.time(),
        "kind": "rank_hung",
        "data": {
            "global_rank": 1,
            "reason": HUNG_REASON,
            "section": "step",
            "notes": [f"Python stacks in {STACKS}"],
        },
    }
    line = describe_event(hung)
    assert f"stacks={STACKS}" in line and "rank 1 sent no heartbeat" in line and "…" in line
    assert len(line) < 400
    reason = f"{HUNG_REASON}; Python stacks in {STACKS}; terminated with SIGTERM"
    failed = {
        "id": 8,
        "time": time.time(),
        "kind": "attempt_failed",
        "data": {"attempt": 3, "failure": {"kind": "hang", "reason": reason}},
    }
    line = describe_event(failed)
    assert f"stacks={STACKS}" in line and line.endswith("terminated with SIGTERM")
    # `ftd top`: the path comes before the long reason, so a narrow screen keeps it
    screen = render(Snapshot(_status(), CLUSTER, [hung], None), 120, 0, False, 1)
    assert any(STACKS in row for row in screen)


def test_a_timeouts_change_shows_before_and_after() -> None:
    previous = _status()["timeouts"]
    after = {**previous, "rank_heartbeat_timeout": 60.0}
    after["rank_section_timeouts"] = {"step": 180.0, "setup": None}
    event = {
        "id": 9,
        "time": time.time(),
        "kind": "timeouts_changed",
        "data": {"timeouts": after, "previous": previous, "by": "operator", "learned": False},
    }
    line = describe_event(event)
    assert "by=operator" in line
    assert "rank_heartbeat_timeout=30→60" in line
    assert "rank_section_timeouts.step=60→180" in line
    assert "initial_rank_heartbeat_timeout" not in line  # unchanged
    old = {**event, "data": {"timeouts": after, "by": "operator"}}  # written before `previous`
    assert "rank_heartbeat_timeout=60" in describe_event(old)


# -- row 10: a requested shutdown is named ---------------------------------------------------


def test_the_last_line_names_what_ended_the_job() -> None:
    asked = "rank 1 failed with exit code 3; not restarted: rank 1 asked to shut the workload down"
    assert ending_headline(asked) == (
        "the job failed and was not restarted, as a rank asked: "
        "rank 1 asked to shut the workload down"
    )
    exhausted = "rank 0 failed with exit code 3; no restarts left (3/3 used)"
    assert ending_headline(exhausted) == "restarts exhausted, the job failed"


async def test_a_shutdown_request_is_not_called_exhausted_restarts(serve: ServeFactory) -> None:
    run = await serve(
        "--nproc-per-node", "2", "--max-restarts", "3",
        script=BIN / "health_worker.py", script_args=("--mode", "workload"),
    )  # fmt: skip
    assert await run.wait() == 1
    assert "restarts exhausted" not in run.stderr.text
    assert (
        "the job failed and was not restarted, as a rank asked: rank 1 asked to shut the "
        "workload down: cannot recover:"
    ) in run.stderr.text


# -- row 13: top's words during a rendezvous, its cut lines, `off` in both --------------------


def test_top_during_a_rendezvous_and_at_the_terminals_width() -> None:
    status = _status(state="rendezvous", round=None, ranks=[])
    cluster = {
        "round": None,
        "nodes": [{"node_id": "vm", "state": "rendezvous", "round": None, "group_rank": None}],
    }
    lines = render(_snapshot(status, cluster), 0, 0, False, 0)
    text = "\n".join(lines)
    assert "None" not in text
    node_row = next(line for line in lines if line.startswith("vm "))
    assert node_row.split()[:4] == ["vm", "rendezvous", "joining", "joining"]
    assert "round joining" in lines[0] and "round joining" in format_status(status, cluster)

    narrow = render(_snapshot(_status()), 50, 0, True, 0)
    cut = [line for line in narrow if "…" in line]
    assert cut and all(line.replace("\x1b[0m", "").endswith("…") for line in cut)
    plain = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in narrow]
    assert all(len(line) <= 50 for line in plain)
    assert render(_snapshot(_status()), 500, 0, False, 0)[0].endswith("…") is False


def test_a_timeout_that_is_off_reads_off_in_status_and_top() -> None:
    status = _status()
    expected = "initial_rank_heartbeat_timeout=off"
    assert expected in format_status(status, CLUSTER)
    assert expected in "\n".join(render(_snapshot(status), 0, 0, False, 0))
    assert "none" not in format_status(status, CLUSTER).split("timeouts:")[1].splitlines()[0]
    assert "rank_section_timeouts=step:60,setup:off" in format_status(status, CLUSTER)


# -- item 1: `ftd top` watching a job whose daemon exits shows its end as final ---------------


class _GoneDaemon:
    """A client whose daemon has exited: every request fails."""

    def status(self) -> dict[str, Any]:
        from ftd_client.admin import ApiUnreachable

        raise ApiUnreachable("connection refused")

    cluster = events = status


def test_top_shows_the_end_once_the_daemon_is_gone(tmp_path: Path) -> None:
    from ftd.cli.top import Feed

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    last = _status(state="failed", last_failure={"kind": "exit", "reason": "exit code 3"})
    (run_dir / "status.json").write_text(json.dumps(last))
    os.chmod(run_dir / "status.json", 0o600)
    stopped = {"id": 12, "time": time.time(), "kind": "daemon_stopped", "data": {"state": "failed"}}
    (run_dir / "events.jsonl").write_text(json.dumps(stopped) + "\n")

    feed = Feed(_GoneDaemon(), str(run_dir))  # type: ignore[arg-type]
    feed.last = _snapshot(_status())  # what it showed while the job ran
    picture = render(feed.refresh(), 0, 0, False, 3)
    assert "FAILED (final)" in picture[0]
    assert "(its daemon stopped)" in picture[1] and "unreachable" not in "\n".join(picture)

    # Without the run directory there is nothing to read: the last picture, with the error.
    blind = Feed(_GoneDaemon())  # type: ignore[arg-type]
    blind.last = _snapshot(_status())
    assert "daemon unreachable" in "\n".join(render(blind.refresh(), 0, 0, False, 3))


# -- a run's record is hostile: any JSON in it is shown or refused, never a traceback ---------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)
_KEYS = list(_status())


@given(
    st.dictionaries(st.sampled_from(_KEYS), _JSON, max_size=12),
    st.dictionaries(st.sampled_from(["round", "nodes", "excluded", "members"]), _JSON),
    st.lists(
        st.fixed_dictionaries(
            {
                "id": st.integers(),
                "time": st.floats() | st.integers(),
                "kind": st.sampled_from(
                    [
                        "daemon_stopped",
                        "state_changed",
                        "rank_hung",
                        "attempt_failed",
                        "timeouts_changed",
                        "recovery",
                        "restart_backoff",
                        "odd",
                    ]
                ),
                "data": st.dictionaries(
                    st.sampled_from(
                        [
                            "state",
                            "reason",
                            "notes",
                            "failure",
                            "timeouts",
                            "previous",
                            "stages",
                            "total_s",
                            "delay_s",
                            "by",
                        ]
                    ),
                    _JSON,
                ),
            }
        ),
        max_size=5,
    ),
)
def test_any_record_is_shown_without_a_traceback(
    status: dict[str, Any], cluster: dict[str, Any], events: list[dict[str, Any]]
) -> None:
    from ftd.cli.run_files import _cluster_view, ending_of, event_record

    parsed = [e for e in (event_record(json.dumps(e, default=str)) for e in events) if e]
    ending = ending_of(status, parsed, None)
    format_status(status, cluster, ending)
    format_status(status, _cluster_view(cluster, status), ending)
    render(Snapshot(status, cluster, parsed, None, ending=ending), 80, 30, True, 5)
    for event in parsed:
        describe_event(event)


def test_a_recovery_line_shows_the_back_off_stage() -> None:
    """The back-off is its own stage of a recovery (no longer inside rendezvous): one-line
    events show it in its place."""
    from ftd.cli.event_lines import describe_event

    stages = {"detect": 0.004, "stop": 0.04, "backoff": 2.0, "rendezvous": 0.01, "spawn": 0.1}
    event = {"id": 9, "time": 0.0, "kind": "recovery", "data": {"attempt": 2, "stages": stages}}
    line = describe_event(event)
    assert "stop 40 ms | backoff 2.00 s | rendezvous 10 ms" in line, line
