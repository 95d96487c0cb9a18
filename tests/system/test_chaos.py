"""The chaos suite: every way the supervisor was once seen to fail, replayed against a live
`ftd serve` with real ranks (issue 15, "the supervisor must never be the fault").

One test per finding, numbered as in the README's "What ftd survives". Each asserts, besides its
own point, what every test here owes: the daemon did not crash (no traceback of its own, no
task error lost), no rank was killed by mistake, no restart was lost, no process outlived the
job, every line of events.jsonl parses, and every refusal said why.

Rows 11 (a squatter on the API port) and 14 (the suite on a busy machine) are covered
elsewhere: tests/api/test_api_admin.py::test_the_cli_finds_its_daemon_and_never_guesses, and the
lead's full runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import (
    BIN,
    ROOT,
    WORKER,
    Serve,
    ServeFactory,
    event_lines,
    events_in,
    pids_with_env,
    wait_pids_gone,
)
from tests.support.checks import (
    AS_ROOT,
    api_session,
    assert_no_orphans,
    assert_sound,
)
from tests.support.cluster import Cluster

CHAOS = BIN / "chaos_rank.py"
HEALTH = BIN / "health_worker.py"
NOBODY = 65534


# -- what every test owes ------------------------------------------------------------------------


async def await_events(run_dir: Path, kind: str, timeout: float = 30.0) -> list[dict[str, Any]]:
    """The events of `kind` once there is one in events.jsonl: a log line can be printed
    before the event it goes with is written."""
    deadline = time.monotonic() + timeout
    for _ in itertools.count():
        found = events_in(run_dir, kind)
        if found or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.05)  # a file written by another process: nothing to await
    raise AssertionError("unreachable")


def status_of(run: Serve) -> dict[str, Any]:
    status: dict[str, Any] = json.loads((run.run_dir / "status.json").read_text())
    return status


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as response:
        assert response.status == 200, await response.text()
        return await response.json()


def overdue_ms(reason: str) -> float:
    match = re.search(r"overdue by ([0-9.]+) ms", reason)
    assert match is not None, reason
    return float(match[1])


async def chaos(serve: ServeFactory, *flags: str, args: tuple[str, ...], **kw: Any) -> Serve:
    """`ftd serve` with tests/bin/chaos_rank.py as the script."""
    return await serve(*flags, script=CHAOS, script_args=args, **kw)


# -- 1. a short subsequent heartbeat timeout after a long initial one ------------------------------


async def test_r01_hang_found_by_the_subsequent_timeout_not_the_initial_one(
    serve: ServeFactory,
) -> None:
    """initial 30 s, subsequent 2 s: a rank heartbeating ~0.5 s then silent is found ~2 s after
    its last heartbeat (it once took 29.6 s: the initial deadline's timer was never moved)."""
    run = await serve(
        "--nproc-per-node", "2", "--max-restarts", "1",
        "--ft-param-initial_rank_heartbeat_timeout=30", "--ft-param-rank_heartbeat_timeout=2",
        script=HEALTH, script_args=("--mode", "stop-heartbeats", "--interval", "0.15"),
    )  # fmt: skip
    assert await run.wait() == 0
    [hang] = events_in(run.run_dir, "rank_hung")
    reason = hang["data"]["reason"]
    assert hang["data"]["global_rank"] == 1
    assert "sent no heartbeat within rank_heartbeat_timeout (2s" in reason, reason
    # Found within the 2 s timeout plus a bounded slack after the last heartbeat.
    assert overdue_ms(reason) < 1000, reason
    [started] = [e for e in events_in(run.run_dir, "attempt_started") if e["data"]["attempt"] == 0]
    assert hang["time"] - started["time"] < 15, "judged by the 30 s initial deadline"
    assert "rank 1 attempt 1 done" in run.stdout.text
    assert_sound(run)
    await assert_no_orphans(run.run_dir)


# -- 2. a hang inside a gloo allreduce: the silent rank is named, every time -----------------------


@pytest.mark.timeout(240)
async def test_r02_hang_in_an_allreduce_names_the_silent_rank_every_time(
    serve: ServeFactory,
) -> None:
    """Three attempts in a row, each with one rank silent and its peer blocked in the
    allreduce waiting for it (rank 1, then rank 0, then rank 1): the silent one is named first
    every time, and every rank judged overdue has its stacks written."""
    run = await chaos(
        serve,
        "--nproc-per-node", "2", "--max-restarts", "3", "--restart-backoff", "0",
        "--ft-param-rank_heartbeat_timeout=2",
        args=("--mode", "gloo-hang", "--bad-attempts", "3", "--interval", "0.1"),
    )  # fmt: skip
    assert await run.wait(timeout=200) == 0, run.stderr.text[-3000:]
    everything = event_lines(run.run_dir)
    attempt, first_hang_of = -1, dict[int, dict[str, Any]]()
    for event in everything:
        if event["kind"] == "attempt_started":
            attempt = event["data"]["attempt"]
        elif event["kind"] == "rank_hung":
            first_hang_of.setdefault(attempt, event["data"])
            data = event["data"]
            judged = [(data["local_rank"], data["global_rank"])] + [
                (rank, rank) for rank in data["also_overdue"]
            ]
            for local_rank, _ in judged:
                stacks = run.attempt_dir(attempt) / str(local_rank) / "stacks.txt"
                assert "chaos_rank.py" in stacks.read_text(), (attempt, data)
    named = {attempt: data["global_rank"] for attempt, data in first_hang_of.items()}
    assert named == {0: 1, 1: 0, 2: 1}, named
    assert "rank 0 attempt 3 done" in run.stdout.text
    assert_sound(run)
    await assert_no_orphans(run.run_dir)


# -- 3. a full disk under --log-dir ----------------------------------------------------------------


def failure_episodes(stderr: str, name: str) -> list[str]:
    """The causes with which writing `name` failed, one per episode: the daemon says a failing
    file once, and again only after it was written again in between (asserted here)."""
    said = re.findall(
        rf"could not (?:write|append to) \S*/{re.escape(name)} \((\w+)|\S*/{re.escape(name)} "
        r"is (written again)",
        stderr,
    )
    return episodes(name, ["ok" if recovered else cause for cause, recovered in said])


def episodes(name: str, sequence: list[str]) -> list[str]:
    """The failures (causes) of a sequence of failures and recoveries ("ok"), which must
    alternate."""
    for earlier, later in itertools.pairwise(sequence):
        assert (earlier == "ok") != (later == "ok"), f"{name} said twice in a row: {sequence}"
    return [entry for entry in sequence if entry != "ok"]


def event_episodes(page: list[dict[str, Any]], name: str) -> list[str]:
    """As failure_episodes, from persist_failed / persist_recovered events."""
    sequence = [
        e["data"].get("cause", "ok")
        for e in page
        if e["kind"] in ("persist_failed", "persist_recovered")
        and Path(e["data"]["path"]).name == name
    ]
    return episodes(name, sequence)


async def test_r03_file_size_limit_supervision_goes_on_and_recovers(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """The daemon under RLIMIT_FSIZE (its writes past 1024 bytes fail with EFBIG, as on a full
    disk): a rank crash is still restarted, each failing file is said once (until it is
    written again), the API tells the truth; once the limit is lifted the files are written
    again and say so."""
    go = tmp_path / "go"
    run = await serve(
        "--nproc-per-node", "2", "--max-restarts", "1", "--start-method", "spawn",
        script_args=("--fail-attempts", "1", "--fail-mode", "exit:3", "--hang-until", str(go)),
        wrap=("prlimit", "--fsize=1024:unlimited", "--"),  # the first status fits, not the next
    )  # fmt: skip
    async with api_session(run) as (session, url, _):
        for rank in (0, 1):
            await run.stdout.expect(rf"ready a1 r{rank} pid", timeout=90)
        status = await get_json(session, f"{url}/v1/status")
        assert (status["state"], status["attempt"], status["restart_count"]) == ("running", 1, 1)
        assert [r["state"] for r in status["ranks"]] == ["running", "running"]
        page = (await get_json(session, f"{url}/v1/events?limit=1000"))["events"]
        assert [e["kind"] for e in page].count("attempt_failed") == 1
        assert set(event_episodes(page, "status.json")) == {"efbig"}
        assert set(event_episodes(page, "events.jsonl")) == {"efbig"}
        stale = status_of(run)  # whole, but from before the ranks: the API is the truth
        assert (stale["attempt"], stale["restart_count"]) == (0, 0), stale
        # The limit is lifted (space freed): the next writes work and say so.
        resource.prlimit(run.proc.pid, resource.RLIMIT_FSIZE, (-1, -1))
        go.touch()
        assert await run.wait() == 0
    stderr = run.stderr.text
    assert set(failure_episodes(stderr, "status.json")) == {"efbig"}
    assert set(failure_episodes(stderr, "events.jsonl")) == {"efbig"}
    assert re.search(r"status\.json is written again", stderr)
    assert re.search(r"events\.jsonl is written again \(\d+ events were kept", stderr)
    assert status_of(run)["state"] == "succeeded"
    written = event_lines(run.run_dir)
    assert written[-1]["kind"] == "daemon_stopped"
    recovered = {Path(e["data"]["path"]).name for e in written if e["kind"] == "persist_recovered"}
    assert recovered == {"status.json", "events.jsonl"}, recovered
    assert_sound(run)
    await assert_no_orphans(run.run_dir)


@pytest.mark.skipif(not AS_ROOT, reason="mounting a small tmpfs needs root")
@pytest.mark.timeout(180)
async def test_r03_full_tmpfs_supervision_goes_on_and_recovers(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """--log-dir on a small tmpfs (2 MiB, 64 inodes). Full at the start: exit 2, saying
    why, no empty token file left. Then ranks printing to files there (-t 3), and it fills up:
    a killed rank's exit is recorded, the next attempts cannot even create their log
    directories and fail (backing off, not crashing the daemon), the API tells the truth all
    along; once space is freed an attempt starts and succeeds, status.json and events.jsonl
    catch up, nothing half written is left."""
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    mount = await asyncio.create_subprocess_exec(
        "mount", "-t", "tmpfs", "-o", "size=2m,nr_inodes=64,mode=0700", "tmpfs", str(logs),
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, why = await mount.communicate()
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {why.decode().strip()}")
    try:
        # Full from the start: a clear refusal, and no empty token file left for the next start.
        full = logs / "full"
        with contextlib.suppress(OSError), full.open("wb") as out:
            while True:
                out.write(b"\0" * 65536)
                out.flush()
        refused = await serve()
        assert await refused.wait() == 2
        last = refused.stderr.lines[-1]
        assert last.startswith("ftd serve: error: cannot write the API token file"), last
        assert last.endswith("No space left on device"), last
        assert not (refused.run_dir / "api.token").exists()
        full.unlink()

        go = tmp_path / "go"
        run = await serve(
            "--nproc-per-node", "2", "--max-restarts", "30", "--start-method", "spawn",
            "--restart-backoff", "0.2:1", "-t", "3",
            script_args=("--hang-until", str(go), "--say", "x" * 2000),
        )  # fmt: skip
        async with api_session(run) as (session, url, _):
            ready = [await run.stdout.expect(rf"ready a0 r{r} pid (\d+)", 90) for r in (0, 1)]
            fillers = logs / "fillers"  # what the ranks' logs would grow into
            fillers.mkdir()
            with contextlib.suppress(OSError), (fillers / "blocks").open("wb") as out:
                while True:
                    out.write(b"\0" * 65536)
                    out.flush()
            with contextlib.suppress(OSError):
                for number in itertools.count():
                    (fillers / str(number)).touch()
            victim = int(ready[0][1])
            os.kill(victim, signal.SIGKILL)
            # Attempts 1 and 2 cannot create their log directories: they fail, one line each.
            for number in (1, 2):
                await run.stderr.expect(
                    rf"\] the ranks of attempt {number} could not be started: .*No space left", 90
                )
            status = await get_json(session, f"{url}/v1/status")
            assert status["last_failure"]["kind"] == "start", status
            assert status["restart_count"] >= 2, status
            assert status["state"] in ("restarting", "rendezvous"), status
            page = (await get_json(session, f"{url}/v1/events?limit=1000"))["events"]
            exits = [e for e in page if e["kind"] == "rank_exited" and e["data"]["pid"] == victim]
            assert [e["data"]["exit_code"] for e in exits] == [-signal.SIGKILL]
            assert "enospc" in event_episodes(page, "status.json"), page
            assert [e for e in page if e["kind"] == "restart_backoff"], page
            go.touch()
            shutil.rmtree(fillers)  # space is freed
            assert await run.wait(timeout=120) == 0, run.stderr.text[-3000:]
        assert status_of(run)["state"] == "succeeded"
        assert set(failure_episodes(run.stderr.text, "status.json")) == {"enospc"}
        assert set(failure_episodes(run.stderr.text, "events.jsonl")) <= {"enospc"}
        assert event_lines(run.run_dir)[-1]["kind"] == "daemon_stopped"
        assert_sound(run)
        await assert_no_orphans(run.run_dir)
    finally:
        umount = await asyncio.create_subprocess_exec("umount", "-l", str(logs))
        await umount.wait()


# -- 4. the daemon stopped (SIGSTOP) for longer than the heartbeat timeout -------------------------


async def test_r04_a_stopped_daemon_judges_no_rank_when_it_resumes(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """Heartbeat timeout 2 s. (a) The daemon alone is stopped 6 s: the ranks' heartbeats
    queued meanwhile are read before any verdict. (b) The daemon and its ranks are stopped
    (a frozen node) 6 s: nothing was queued, the timers fire late, and the daemon knows it
    was the one not running: a fresh grace period, counted in ipc.stalls, no verdict."""
    go = tmp_path / "go"
    run = await chaos(
        serve,
        "--nproc-per-node", "2", "--ft-param-rank_heartbeat_timeout=2",
        args=("--mode", "beat", "--until", str(go), "--interval", "0.05"),
    )  # fmt: skip
    async with api_session(run) as (session, url, _):
        ranks = [
            int((await run.stdout.expect(rf"rank {rank} attempt 0 up pid (\d+)", 90))[1])
            for rank in (0, 1)
        ]

        run.signal(signal.SIGSTOP)  # (a)
        await asyncio.sleep(6)  # the fault itself: 3x the timeout
        run.signal(signal.SIGCONT)
        status = await get_json(session, f"{url}/v1/status")  # due timers ran before this
        assert [r["state"] for r in status["ranks"]] == ["running", "running"], status
        assert "hung:" not in run.stderr.text

        for pid in ranks:  # (b): the ranks first, their last messages read, then the daemon
            os.kill(pid, signal.SIGSTOP)
        await get_json(session, f"{url}/v1/status")
        run.signal(signal.SIGSTOP)
        await asyncio.sleep(6)
        run.signal(signal.SIGCONT)
        await run.stderr.expect(r"the daemon did not run for [0-9.]+ s", timeout=30)
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)
        status = await get_json(session, f"{url}/v1/status")
        assert status["ipc"]["stalls"] >= 1, status["ipc"]
        assert [r["state"] for r in status["ranks"]] == ["running", "running"], status
        go.touch()
        assert await run.wait() == 0
    assert events_in(run.run_dir, "rank_hung") == []
    assert "hung:" not in run.stderr.text
    assert_sound(run)
    await assert_no_orphans(run.run_dir)


# -- 5. a timeout too small to be one -------------------------------------------------------------

TINY = "5e-324"


async def test_r05_subnormal_timeouts_are_refused_from_every_source(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """5e-324 s (and its kin) once made every rank hung. Refused naming the 0.1 s bound: by
    the API (400 problem+json), a rank's `set` message, `ftd timeouts set`, the serve flags and
    the YAML file (exit 2, one line)."""
    config = tmp_path / "ft.yaml"
    config.write_text(f"fault_tolerance:\n  rank_out_of_section_timeout: {TINY}\n")
    for flags in (
        [f"--ft-param-rank_out_of_section_timeout={TINY}"],
        ["--ft-rank-out-of-section-timeout", TINY],
        ["--ft-cfg-path", str(config)],
    ):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ftd", "serve", *flags, str(WORKER),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=str(tmp_path),
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        lines = err.decode().strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (flags, lines)
        assert "rank_out_of_section_timeout" in lines[0] and "0.1" in lines[0], lines

    go = tmp_path / "go"
    run = await chaos(
        serve,
        "--nproc-per-node", "1", "--ft-param-rank_out_of_section_timeout=300",
        args=("--mode", "set-timeouts", "--until", str(go)),
    )  # fmt: skip
    async with api_session(run) as (session, url, token):
        reply = json.loads(
            (await run.stdout.expect(r"rank 0 attempt 0 set reply (.*)$", timeout=90))[1]
        )
        assert reply["ok"] is False and "0.1" in reply["error"], reply
        headers = {"Authorization": f"Bearer {token}"}
        bad = {  # the literal sent: what the refusal names
            **dict.fromkeys(("5e-324", "0", "-1", "0.05"), "0.1"),
            "1e308": "2592000",
            "true": "rank_out_of_section_timeout",
            "NaN": "NaN",
            "Infinity": "Infinity",
        }
        for literal, named in bad.items():
            async with session.patch(
                f"{url}/v1/timeouts",
                data=f'{{"rank_out_of_section_timeout": {literal}}}',
                headers={**headers, "Content-Type": "application/json"},
            ) as response:
                problem = await response.json(content_type=None)
                assert response.status == 400, (literal, problem)
                assert response.content_type == "application/problem+json"
                assert named in problem["detail"], (literal, problem)
        async with session.patch(
            f"{url}/v1/timeouts", json={"rank_out_of_section_timeout": 5e-324}, headers=headers
        ) as response:
            assert "0.1" in (await response.json(content_type=None))["detail"]
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "ftd", "timeouts", "set", f"rank_out_of_section_timeout={TINY}",
             "--run-dir", str(run.run_dir)],
            capture_output=True, text=True, cwd=ROOT, timeout=60,
        )  # fmt: skip
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1, done  # the daemon refused it
        assert "rank_out_of_section_timeout" in lines[0] and "0.1" in lines[0], lines
        timeouts = await get_json(session, f"{url}/v1/timeouts")
        assert timeouts["rank_out_of_section_timeout"] == 300
        go.touch()
        assert await run.wait() == 0
    assert events_in(run.run_dir, "rank_hung") == []
    assert events_in(run.run_dir, "timeouts_changed") == []
    assert_sound(run)
    await assert_no_orphans(run.run_dir)


# -- 6. a stack-dump signal no signal has --------------------------------------------------------


async def test_r06_a_bogus_stack_signal_does_not_save_a_hung_rank(serve: ServeFactory) -> None:
    """A rank's handshakes name SIGKILL, SIGSTOP, -1, 0, true, "10" and 2**70 as its stack
    dump signal, then it hangs: the daemon refused them all (no dump asked), so the hang is
    still explained, the rank killed and the job restarted. (Without --progress off the rank's
    progress observer registers a real dump of its own, and the daemon uses that one.)"""
    run = await chaos(
        serve,
        "--nproc-per-node", "2", "--max-restarts", "1", "--ft-param-rank_heartbeat_timeout=2",
        "--progress", "off",
        args=("--mode", "bad-stack-signal", "--bad-rank", "0", "--seconds", "0.5"),
    )  # fmt: skip
    assert await run.wait() == 0, run.stderr.text[-3000:]
    [hang] = events_in(run.run_dir, "rank_hung")
    assert hang["data"]["global_rank"] == 0
    assert any("did not register a stack dump" in note for note in hang["data"]["notes"]), hang
    [killed] = [
        e for e in events_in(run.run_dir, "rank_exited") if e["data"]["pid"] == hang["data"]["pid"]
    ]
    assert killed["data"]["exit_code"] == -signal.SIGKILL
    assert "rank 0 attempt 1 done" in run.stdout.text
    assert "internal_error" not in status_of(run)["ipc"]["dropped"]
    assert_sound(run)
    await assert_no_orphans(run.run_dir)


# -- 7. deeply nested JSON from a rank -------------------------------------------------------------


async def test_r07_deeply_nested_packets_are_dropped_and_counted(serve: ServeFactory) -> None:
    run = await chaos(
        serve,
        "--nproc-per-node", "2", "--ft-param-rank_heartbeat_timeout=2",
        args=("--mode", "nested", "--seconds", "0.5"),
    )  # fmt: skip
    assert await run.wait() == 0, run.stderr.text[-3000:]
    reply = json.loads(
        run.stdout.text.split("rank 0 attempt 0 nested reply ", 1)[1].splitlines()[0]
    )
    assert reply["ok"] is False and reply["id"] == 7, reply
    dropped = status_of(run)["ipc"]["dropped"]
    # The two deep packets are malformed; the `set` whose timeouts are no object is refused by
    # the door as a request its handler cannot use (issue 39 item 7).
    assert dropped == {"malformed": 2, "bad_request": 1}, dropped
    assert len(re.findall(r"dropped a message from pid \d+ \(malformed", run.stderr.text)) == 1
    assert events_in(run.run_dir, "rank_hung") == []
    assert status_of(run)["restart_count"] == 0
    assert "rank 1 attempt 0 done" in run.stdout.text and "rank 0 attempt 0 done" in run.stdout.text
    assert_sound(run)
    await assert_no_orphans(run.run_dir)


# -- 8. a stranger holding thousands of rank-socket connections ------------------------------------

STRANGER = """
import resource, socket, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
held = []
for _ in range(int(sys.argv[2])):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(sys.argv[1])
    held.append(sock)
print("held", len(held), flush=True)
sys.stdin.read()
"""


@pytest.mark.timeout(180)
async def test_r08_a_stranger_holding_4094_connections_takes_no_rank_slot(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """A same-user process that is no rank opens 4094 idle connections to the rank socket,
    then a rank crashes: the restarted ranks connect and are watched (a hang is still caught),
    the stranger's connections were refused at accept and said once."""
    go = tmp_path / "go"
    run = await chaos(
        serve,
        "--nproc-per-node", "2", "--max-restarts", "2", "--restart-backoff", "0",
        "--ft-param-rank_heartbeat_timeout=1.5",
        args=("--mode", "crash-then-hang", "--until", str(go), "--seconds", "1"),
    )  # fmt: skip
    for rank in (0, 1):
        await run.stdout.expect(rf"rank {rank} attempt 0 up", timeout=90)
    stranger = await asyncio.create_subprocess_exec(
        sys.executable, "-c", STRANGER, str(await run.rank_socket()), "4094",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert stranger.stdout is not None
        line = await asyncio.wait_for(stranger.stdout.readline(), 120)
        assert line.decode().strip() == "held 4094"
        go.touch()
        assert await run.wait(timeout=150) == 0, run.stderr.text[-3000:]
    finally:
        assert stranger.stdin is not None
        stranger.stdin.close()
        with contextlib.suppress(ProcessLookupError):
            stranger.kill()
        await stranger.wait()
    [hang] = events_in(run.run_dir, "rank_hung")
    assert hang["data"]["global_rank"] == 1
    assert "rank 1 attempt 2 done" in run.stdout.text
    assert status_of(run)["ipc"]["dropped"].get("not_a_rank", 0) >= 4094
    refusals = re.findall(rf"pid {stranger.pid} .*refused a connection", run.stderr.text)
    assert len(refusals) == 1, refusals
    assert_sound(run)
    await assert_no_orphans(run.run_dir)


# -- 9. a crash loop -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("start", "source"),
    [(("-r", "3"), "error.json"), (("--start-method", "spawn", "-t", "3"), "error_file: <N/A>")],
    ids=["zygote", "spawn"],
)
async def test_r09_a_crash_loop_backs_off_and_the_summary_names_the_import_error(
    serve: ServeFactory, tmp_path: Path, start: tuple[str, ...], source: str
) -> None:
    """A script that fails at import, every attempt: the restarts wait longer and longer
    (restart_backoff events, status backoff_s), and the failure summary shows the
    ModuleNotFoundError (the zygote's rank writes it to the error file; a spawned rank writes
    none, and the cause shown is its stderr's last lines)."""
    script = tmp_path / "broken_train.py"
    script.write_text("import ftd_chaos_no_such_module  # noqa\n")
    run = await serve(
        "--nproc-per-node", "1", "--max-restarts", "3", "--restart-backoff", "0.3:5", *start,
        script=script,
    )  # fmt: skip
    assert await run.wait() == 1
    backoffs = [e["data"] for e in events_in(run.run_dir, "restart_backoff")]
    delays = [b["delay_s"] for b in backoffs]
    assert delays == [0.3, 0.6], backoffs
    starts = [e["time"] for e in events_in(run.run_dir, "attempt_started")]
    assert len(starts) == 4
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    assert gaps[1] >= 0.3 and gaps[2] >= 0.6, gaps
    assert status_of(run)["backoff_s"] == 0.6
    summary = run.stderr.text[run.stderr.text.index("restarts exhausted") :]
    expected = "ModuleNotFoundError: No module named 'ftd_chaos_no_such_module'"
    assert expected in [line.strip() for line in summary.splitlines()], summary
    assert source in summary, summary
    assert_sound(run)
    await assert_no_orphans(run.run_dir)


# -- 10. a log directory someone else prepared -----------------------------------------------------


def plant(victims: Path, directory: Path, names: list[str]) -> dict[Path, str]:
    """A symlink at each name in `directory` to a precious file of ours; {file: content}."""
    victims.mkdir(exist_ok=True)
    precious = {}
    for number, name in enumerate(names):
        target = victims / f"precious_{number}"
        target.write_text(f"precious {number}\n")
        (directory / name).symlink_to(target)
        precious[target] = target.read_text()
    return precious


def untouched(precious: dict[Path, str]) -> None:
    for target, content in precious.items():
        assert target.read_text() == content, f"{target} was written through a link"


@pytest.mark.skipif(not AS_ROOT, reason="needs root to play another local user (chown)")
async def test_r10_another_users_log_dir_is_refused(tmp_path: Path) -> None:
    """A root daemon given a --log-dir another local user owns, with links and a token file
    planted in it: exit 2 saying why, nothing written anywhere."""
    victims = tmp_path / "victims"
    cases: list[tuple[Path, str]] = []
    # The run directory is theirs.
    theirs = tmp_path / "theirs"
    run_dir = theirs / "job"
    run_dir.mkdir(parents=True)
    precious = plant(victims, run_dir, ["status.json", "events.jsonl", ".api.json.tmp"])
    token = run_dir / "api.token"
    token.write_text("planted-token-0123456789abcdef\n")
    token.chmod(0o600)
    for path in (theirs, run_dir, token):
        os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
    cases.append((theirs, "belongs to uid 65534"))
    # A directory above the run directory is theirs (they could swap the run dir for a link).
    above = tmp_path / "above"
    above.mkdir()
    os.chown(above, NOBODY, NOBODY)
    cases.append((above, "above the run directory"))
    for log_dir, reason in cases:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ftd", "serve", "--log-dir", str(log_dir), "--run-id", "job",
            "--api-port", "0", str(WORKER),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=str(ROOT),
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        lines = err.decode().strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, lines
        assert lines[0].startswith("ftd serve: error:") and reason in lines[0], lines
    untouched(precious)
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".api.json.tmp", "api.token", "events.jsonl", "status.json",
    ]  # fmt: skip
    assert not (above / "job").exists()


PLANT_AT_TEMPORARY_NAMES = """
for n in 0 1; do
  for name in status.json cluster.json ft_state.json; do
    ln -s "$VICTIM" "$RUN_DIR/.$name.$$.$n.tmp"
  done
done
exec "$@"
"""


async def test_r10_links_planted_in_our_own_run_dir_are_never_followed(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """In a private run directory of our own, links at events.jsonl (refused: exit 2), at
    status.json, cluster.json and api.json's old temporary name (replaced by the file, or
    never used; the targets untouched) and at the daemon's first temporary names (those
    writes are refused and said; the next names work)."""
    victims = tmp_path / "victims"
    run_dir = tmp_path / "logs" / "test"
    run_dir.mkdir(parents=True, mode=0o700)
    (tmp_path / "logs").chmod(0o700)
    linked = plant(victims, run_dir, ["events.jsonl"])
    refused = await serve(script_args=())
    assert await refused.wait() == 2
    lines = refused.stderr.text.strip().splitlines()
    assert len(lines) == 1 and "events.jsonl" in lines[0] and "link" in lines[0], lines
    untouched(linked)
    (run_dir / "events.jsonl").unlink()

    precious = plant(victims, run_dir, ["status.json", "cluster.json", ".api.json.tmp"])
    victim = victims / "precious_tmp"
    victim.write_text("precious tmp\n")
    precious[victim] = victim.read_text()
    run = await serve(
        "--nproc-per-node", "2",
        wrap=("env", f"VICTIM={victim}", f"RUN_DIR={run_dir}", "sh", "-c",
              PLANT_AT_TEMPORARY_NAMES, "sh"),
    )  # fmt: skip
    assert await run.wait() == 0, run.stderr.text[-3000:]
    untouched(precious)
    for name in ("status.json", "cluster.json"):
        assert not (run_dir / name).is_symlink(), name
    assert status_of(run)["state"] == "succeeded"
    # The first two writes (whichever files) met a planted link at their temporary name.
    failed = [e["data"]["cause"] for e in events_in(run_dir, "persist_failed")]
    assert failed and set(failed) == {"eexist"}, failed
    for planted in run_dir.glob(".*.tmp"):  # ours, still pointing where we left them
        assert planted.is_symlink()
        planted.unlink()
    assert_sound(run)
    await assert_no_orphans(run.run_dir)


# -- 12. the orphan guard killed, then the daemon ------------------------------------------------


def guard_of(daemon_id: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                if b"ftd.ranks.guard" in argv and daemon_id.encode() in argv:
                    found.append(int(entry))
    return found


async def test_r12_a_killed_guard_is_replaced_and_no_rank_outlives_a_killed_daemon(
    serve: ServeFactory,
) -> None:
    run = await serve("--nproc-per-node", "2", script_args=("--hang", "--children"))
    children, ranks = [], []
    for rank in (0, 1):
        match = await run.stdout.expect(rf"children r{rank} (\d+) (\d+)", timeout=90)
        children += [int(match[1]), int(match[2])]
        ranks.append(int((await run.stdout.expect(rf"ready a0 r{rank} pid (\d+)"))[1]))
    environ = Path(f"/proc/{ranks[0]}/environ").read_bytes().split(b"\0")
    daemon_id = next(v for v in environ if v.startswith(b"FTD_DAEMON_ID=")).decode().split("=")[1]
    [guard] = guard_of(daemon_id)
    os.kill(guard, signal.SIGKILL)
    match = await run.stderr.expect(
        rf"the orphan guard \(pid {guard}\) died: started another \(pid (\d+)\)"
    )
    replacement = int(match[1])
    assert replacement != guard
    deadline = time.monotonic() + 30
    while (found := guard_of(daemon_id)) != [replacement]:  # seen once as [] right after
        stat = Path(f"/proc/{replacement}/stat")
        state = stat.read_text() if stat.exists() else "gone"
        assert time.monotonic() < deadline, f"guards {found}; the replacement: {state}"
        await asyncio.sleep(0.05)
    [restarted] = await await_events(run.run_dir, "guard_restarted")
    assert restarted["data"] == {"old_pid": guard, "pid": replacement}
    run.signal(signal.SIGKILL)
    assert await run.wait() == -signal.SIGKILL
    assert await wait_pids_gone([*ranks, *children, replacement], timeout=30) == []
    assert pids_with_env("FTD_DAEMON_ID", daemon_id) == []
    event_lines(run.run_dir)


# -- 13. a round ended by another node's request ---------------------------------------------------


@pytest.mark.timeout(180)
async def test_r13_a_round_ended_elsewhere_judges_no_stopping_rank(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """Two nodes; a rank on node b crashes. Node a's round is ended by b's request through the
    store; its rank ignores SIGTERM and stops heartbeating (heartbeat timeout 1.5 s, grace
    4 s): it is being stopped, not hung, and nobody says otherwise."""
    cluster = Cluster(
        serve, "2", "--max-restarts", "1", "--restart-backoff", "0", "--shutdown-timeout", "4",
        "--ft-param-rank_heartbeat_timeout=1.5",
    )  # fmt: skip
    markers = tmp_path / "markers"
    markers.mkdir()
    args = ("--mode", "stubborn", "--bad-rank", "1", "--until", str(markers), "--seconds", "1")
    a, b = [
        await chaos(serve, "--node-id", node, *cluster.flags, args=args, run_id=cluster.job)
        for node in ("a", "b")
    ]
    assert await a.wait(timeout=150) == 0, a.stderr.text[-3000:]
    assert await b.wait(timeout=60) == 0, b.stderr.text[-3000:]
    assert "rank 0 attempt 0 ignores SIGTERM" in a.stdout.text
    [request] = events_in(a.log_dir / "a" / a.run_id, "cluster_request")
    assert request["data"]["by"] == "b"
    for run, node in ((a, "a"), (b, "b")):
        run_dir = run.log_dir / node / run.run_id
        assert events_in(run_dir, "rank_hung") == [], node
        assert "hung:" not in run.stderr.text
        assert_sound(run, run_dir)
        await assert_no_orphans(run_dir)


# -- 15. the workers' store cannot bind ------------------------------------------------------------


async def test_r15_a_workers_store_that_cannot_bind_is_retried_in_one_line(
    serve: ServeFactory,
) -> None:
    """--master-port on a port another socket holds: one line per try, no traceback, and the
    job starts once the port is free; with a short join timeout the daemon gives up saying
    why."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = str(holder.getsockname()[1])
    try:
        gives_up = await serve("--master-port", port, "--rdzv-join-timeout", "1", run_id="gives-up")
        assert await gives_up.wait() == 1
        assert re.search(r"cannot host the workers' store: .*", gives_up.stderr.text)
        assert "Traceback" not in gives_up.stderr.text
        run = await serve("--master-port", port, "--nproc-per-node", "1")
        await run.stderr.expect(r"cannot host the workers' store \(.*\); trying again in", 90)
    finally:
        holder.close()
    assert await run.wait() == 0, run.stderr.text[-3000:]
    assert "ready a0 r0" in run.stdout.text
    assert_sound(run)
    await assert_no_orphans(run.run_dir)


# -- 16. secrets in a rank's environment ----------------------------------------------------------


@pytest.mark.parametrize("start", [(), ("--start-method", "spawn")], ids=["zygote", "spawn"])
async def test_r16_no_token_or_secret_reaches_a_rank(
    serve: ServeFactory, start: tuple[str, ...]
) -> None:
    token, secret = "chaos-api-token-0123456789", "chaos-rdzv-secret-0123456789"
    run = await serve(
        "--nproc-per-node", "1", *start,
        script_args=("--dump-env",),
        env={"FTD_API_TOKEN": token, "FTD_RDZV_SECRET": secret},
    )  # fmt: skip
    assert await run.wait() == 0, run.stderr.text[-3000:]
    env = json.loads((run.out / "env_0.json").read_text())
    assert "FTD_API_TOKEN" not in env and "FTD_RDZV_SECRET" not in env
    assert not [k for k, v in env.items() if token in v or secret in v]
    assert env["FTD_RUN_DIR"] == str(run.run_dir)  # the dump is the rank's real environment
    assert_sound(run)
    await assert_no_orphans(run.run_dir)
