"""Issue 39's rows on live daemons: what a rank (or another local user) can do through the
doors that came with the memory tier and progress observation — a FIFO in a snapshot slot,
a progress report without its counts, endless automatic-section names, floods of restore
requests and of `cks`, a hang inside a section without a timeout, junk on /dev/shm. Each
fails on the daemon as it was before issue 39 and holds now."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BIN, Serve, ServeFactory
from tests.support.api import Api, api_of

DOOR_RANK = BIN / "door_rank.py"
SHM = Path("/dev/shm")

pytestmark = pytest.mark.timeout(240)


async def door_result(run: Serve, out: Path, timeout: float = 120.0) -> dict[str, Any]:
    """The rank's door.json, once it wrote it (the daemon answered what it asked)."""
    path = out / "door.json"

    async def written() -> dict[str, Any]:
        while not path.exists():
            if run.proc.returncode is not None:
                raise AssertionError(f"ftd serve ended:\n{run.stderr.text[-3000:]}")
            await asyncio.sleep(0.05)
        result: dict[str, Any] = json.loads(path.read_text())
        return result

    return await asyncio.wait_for(written(), timeout)


async def release(run: Serve, out: Path) -> int:
    (out / "release").touch()
    return await run.wait()


async def status_of(api: Api) -> dict[str, Any]:
    code, status, _ = await api.call("GET", "/v1/status")
    assert code == 200, status
    result: dict[str, Any] = status
    return result


def no_traceback(run: Serve) -> None:
    assert "Traceback (most recent call last)" not in run.stderr.text, run.stderr.text[-3000:]
    assert "internal error" not in run.stderr.text, run.stderr.text[-3000:]


def door_args(tmp_path: Path, mode: str, n: int) -> tuple[str, ...]:
    return (mode, "--out", str(tmp_path / "door"), "-n", str(n))


async def start(
    serve: ServeFactory, tmp_path: Path, mode: str, *flags: str, n: int = 1000
) -> Serve:
    return await serve(
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        *flags,
        script=DOOR_RANK,
        script_args=door_args(tmp_path, mode, n),
    )


async def test_row3_a_fifo_in_a_snapshot_slot_freezes_nothing(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """The daemon read a slot's header on its loop without O_NONBLOCK: a FIFO there froze it
    (no API, no verdicts, SIGTERM ignored). Now the slot is refused as not a regular file."""
    run = await start(serve, tmp_path, "fifo-slot")
    result = await door_result(run, tmp_path / "door")
    assert result["grant"]["ok"] is True, result
    assert result["done"]["ok"] is False and "not a regular file" in result["done"]["error"]
    async with api_of(run) as api:
        checkpoint = (await status_of(api))["checkpoint"]
        assert checkpoint["bad_snapshots"] == 1, checkpoint
    assert await release(run, tmp_path / "door") == 0
    no_traceback(run)


async def test_row10_a_progress_report_without_its_counts_is_refused_at_the_door(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """`{"v":1,"t":"pg"}` passed the decoder and raised KeyError in the progress watch (an
    internal error, counted as a daemon bug); now the decoder refuses it."""
    run = await start(serve, tmp_path, "pg-empty")
    await door_result(run, tmp_path / "door")
    async with api_of(run) as api:
        for _ in range(200):  # the packet may still be queued behind the rank's first ones
            dropped = (await status_of(api))["ipc"]["dropped"]
            if dropped:
                break
            await asyncio.sleep(0.05)
    assert dropped == {"bad_progress": 1}, dropped
    assert await release(run, tmp_path / "door") == 0
    no_traceback(run)


async def test_row7_automatic_section_names_are_learned_within_a_budget(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """960 k automatic-section names took a daemon from 258 to 487 MB, never freed: now the
    node learns the durations of 256 names at most, the rest are refused, counted and said
    once (a budget_exceeded event)."""
    run = await start(serve, tmp_path, "auto-names", n=2000)
    await door_result(run, tmp_path / "door")
    async with api_of(run) as api:
        for _ in range(400):
            refusals = (await status_of(api))["ipc"]["budget_refusals"]
            if refusals.get("auto_section_names", 0) >= 2000 - 256:
                break
            await asyncio.sleep(0.05)
    assert refusals == {"auto_section_names": 2000 - 256}, refusals
    exceeded = run.event_data("budget_exceeded")
    assert [e["budget"] for e in exceeded] == ["auto_section_names"], exceeded
    assert await release(run, tmp_path / "door") == 0
    no_traceback(run)


async def test_row8_a_flood_of_restore_requests_is_no_flood_of_events(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """30 k `ckr` made 30 k events (events.jsonl +4 MB, the 10 k event ring wiped): now a
    rank's messages add at most 200 events at once and 20 a second; the rest are counted and
    the flood is one budget_exceeded event. Every request is still answered."""
    run = await start(serve, tmp_path, "ckr-flood", n=5000)
    result = await door_result(run, tmp_path / "door")
    assert result == {"sent": 5000, "ok": 5000}, result
    restored = run.event_data("checkpoint_restored")
    assert 200 <= len(restored) < 1000, len(restored)
    [exceeded] = run.event_data("budget_exceeded")
    assert exceeded["budget"] == "events" and exceeded["global_rank"] == 0, exceeded
    assert [e["kind"] for e in run.events("daemon_started")] == ["daemon_started"]
    async with api_of(run) as api:
        code, events, _ = await api.call("GET", "/v1/events?since=0&limit=1")
        assert code == 200 and events["events"][0]["id"] == 1, events  # the ring kept its start
        refused = (await status_of(api))["ipc"]["budget_refusals"]["events"]
        assert refused + len(restored) == 5000, refused
    assert await release(run, tmp_path / "door") == 0
    no_traceback(run)


async def test_row9_alternating_cks_cannot_run_up_the_steps_lost(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """Alternating `cks` far ahead and "restored from disk at step 0" pushed steps_lost to
    9.0e18: a restore counts once per fault that began a restart, a step far past the rank's
    last is not believed, and no restore loses more than MAX_STEP_JUMP steps."""
    from ftd.checkpoint.restores import MAX_STEP_JUMP

    run = await start(serve, tmp_path, "cks-alternate", n=1000)
    await door_result(run, tmp_path / "door")
    async with api_of(run) as api:
        for _ in range(200):
            checkpoint = (await status_of(api))["checkpoint"]
            if checkpoint is not None and checkpoint["last_restore"] is not None:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # the rest of the 2000 messages
        checkpoint = (await status_of(api))["checkpoint"]
    assert checkpoint["steps_lost"] <= MAX_STEP_JUMP, checkpoint
    assert len(run.event_data("checkpoint_restored")) <= 250
    assert await release(run, tmp_path / "door") == 0
    no_traceback(run)


async def test_row6_a_hang_inside_a_section_without_a_timeout_is_judged_by_progress(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """Any open section with no timeout (the default) switched the progress verdicts off:
    now only a section whose timeout is in force is left to that timeout; an untimed one is
    judged by the progress deadline."""
    run = await serve(
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        "--progress-timeout-floor",
        "3",
        script=DOOR_RANK,
        script_args=door_args(tmp_path, "section-hang", 0),
    )
    await run.stdout.expect("hanging in an untimed section", timeout=120)
    assert await run.wait(timeout=120) == 1, run.stderr.text[-3000:]
    [hung] = run.event_data("rank_hung")
    assert hung["global_rank"] == 0 and "progress deadline" in hung["reason"], hung
    no_traceback(run)


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


async def test_row11_junk_on_dev_shm_hides_no_stale_memory_directory(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """The sweep of /dev/shm listed every entry, then looked at the first 10 000: 200 k junk
    entries hid a dead daemon's memory directory for good. Now names are filtered as they are
    read, and only directories named like ftd's count toward the cap."""
    from ftd.checkpoint.memory_dir import PREFIX, pid_namespace

    if not os.access(SHM, os.W_OK):
        pytest.skip("/dev/shm is not writable here")
    junk = SHM
    tag = f"ftd-test-junk-{os.getpid()}-"
    stale = SHM / f"{PREFIX}{pid_namespace()}-{dead_pid()}-junktest"
    made = 0
    try:
        stale.mkdir(mode=0o700)
        (stale / "rank0.0").write_bytes(b"\0" * 4096)
        for i in range(120_000):  # after the stale directory: tmpfs lists the newest first
            os.close(os.open(junk / f"{tag}{i}", os.O_CREAT | os.O_WRONLY, 0o600))
            made += 1
        run = await start(serve, tmp_path, "ckr-flood", n=1)
        await door_result(run, tmp_path / "door")
        assert not stale.exists(), "the dead daemon's memory directory is still there"
        assert await release(run, tmp_path / "door") == 0
        no_traceback(run)
    finally:
        for i in range(made):
            (junk / f"{tag}{i}").unlink(missing_ok=True)
        if stale.exists():
            for child in stale.iterdir():
                child.unlink()
            stale.rmdir()


async def test_the_daemon_still_ends_on_sigterm_after_the_doors_were_knocked(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """After a FIFO in a slot the daemon still ends on SIGTERM, at once (it ignored it)."""
    run = await start(serve, tmp_path, "fifo-slot")
    await door_result(run, tmp_path / "door")
    run.signal(signal.SIGTERM)
    assert await run.wait(timeout=60) == 128 + signal.SIGTERM
    no_traceback(run)


async def test_what_another_user_places_on_dev_shm_is_left_alone_and_freezes_nothing(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """Entries `nobody` owns, named like a dead daemon's memory directory — a directory with a
    FIFO in it, a FIFO, a link to one of this user's directories — are neither followed,
    opened nor removed: the daemon starts, serves its ranks and ends as usual."""
    import pwd

    from ftd.checkpoint.memory_dir import PREFIX, pid_namespace

    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody here")
    if os.geteuid() != 0 or not os.access(SHM, os.W_OK):
        pytest.skip("needs root (to act as another user) and a writable /dev/shm")
    base = f"{PREFIX}{pid_namespace()}-{dead_pid()}"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep").write_text("kept")
    planted = {
        "dir": SHM / f"{base}-nobodydir",
        "fifo": SHM / f"{base}-nobodyfifo",
        "link": SHM / f"{base}-nobodylink",
    }
    try:
        planted["dir"].mkdir(mode=0o700)
        os.mkfifo(planted["dir"] / "rank0.0")
        os.mkfifo(planted["fifo"])
        planted["link"].symlink_to(mine)
        for path in planted.values():
            os.lchown(path, nobody.pw_uid, nobody.pw_gid)
        run = await start(serve, tmp_path, "ckr-flood", n=1)
        await door_result(run, tmp_path / "door")
        assert await release(run, tmp_path / "door") == 0
        no_traceback(run)
        assert all(os.path.lexists(path) for path in planted.values()), planted
        assert (mine / "keep").read_text() == "kept"
    finally:
        for path in planted.values():
            if path.is_symlink() or path.is_fifo():
                path.unlink()
            elif path.is_dir():
                for child in path.iterdir():
                    child.unlink()
                path.rmdir()
