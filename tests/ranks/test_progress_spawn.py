"""`--start-method spawn` with FTD_PROGRESS=1: the rank runs through script_boot.py, which
observes its progress, and the script cannot tell: the same argv, `__main__`, sys.path,
environment (apart from FTD_*), pickling, exit code, traceback and error file as the plain
`python -u [-m] target` that runs without FTD_PROGRESS (whose command line stays today's)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import BIN, ROOT, Serve, ServeFactory
from tests.support.checks import api_session

SPAWN = ("--start-method", "spawn", "--nproc-per-node", "1")
PROBE = BIN / "progress_spawn_probe.py"
PROBE_MODULE = "tests.bin.progress_spawn_probe"
# Values that differ between two runs whatever starts the ranks.
PER_RUN = {
    "MASTER_PORT",
    "FTD_RUN_DIR",
    "FTD_DAEMON_ID",
    "FTD_SOCKET",
    "FTD_STACKS_FILE",
    "FT_RANK_MONITOR_IPC_SOCKET",
    "FT_LAUNCHER_IPC_SOCKET",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_RUN_ID",
}
OFF_AND_ON = (("plain", "off"), ("observed", "on"))


async def start_pair(
    serve: ServeFactory, module: bool, script_args: tuple[str, ...], *flags: str
) -> dict[str, Serve]:
    """The same rank started by two daemons, --progress off and on (run ids: plain, observed)."""
    target = ("--module",) if module else ()
    return {
        name: await serve(
            *SPAWN,
            *flags,
            *target,
            "--progress",
            value,
            script=PROBE_MODULE if module else PROBE,
            script_args=script_args,
            run_id=name,
        )
        for name, value in OFF_AND_ON
    }


@pytest.mark.parametrize("module", [False, True], ids=["script", "module"])
async def test_the_script_sees_what_python_gives_it(
    serve: ServeFactory, tmp_path: Path, module: bool
) -> None:
    release, out = tmp_path / "release", tmp_path / "out"
    args = ("--out", str(out), "--release", str(release))
    runs = await start_pair(serve, module, args)
    for run in runs.values():
        await run.stdout.expect("reported r0", timeout=120)
    await records_arrive(runs["observed"])
    release.touch()
    for run in runs.values():
        assert await run.wait() == 0
        assert "progress is not observed" not in run.stderr.text
    assert runs["observed"].status()["ipc"]["dropped"] == {}  # type: ignore[index]
    plain, observed = (report(out / name) for name, _ in OFF_AND_ON)
    assert (plain["progress_thread"], observed["progress_thread"]) == (False, True)
    # Without FTD_PROGRESS the command line is today's, torchrun's.
    target = ["-m", PROBE_MODULE] if module else [str(PROBE)]
    assert plain["orig_argv"] == [sys.executable, "-u", *target, *args]
    for key in (
        "orig_argv",
        "argv",
        "name",
        "main_is_this",
        "file",
        "cached",
        "spec",
        "loader",
        "package",
        "path",
        "cwd",
        "round_trip",
    ):
        assert observed[key] == plain[key], key
    assert observed["path"][0] == str(ROOT if module else PROBE.resolve().parent)
    assert observed["spec"] == (PROBE_MODULE if module else None)
    assert observed["round_trip"] == {"value": 42, "class": "__main__.Shipped"}
    ours, theirs = observed["env"], plain["env"]
    assert set(ours) == set(theirs)  # nothing added, FTD_* included
    differing = {key for key in ours if ours[key] != theirs[key]}
    assert differing <= PER_RUN | {"FTD_PROGRESS"}, differing


async def test_a_raising_script_fails_as_python_makes_it(
    serve: ServeFactory, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    runs = await start_pair(serve, False, ("--out", str(out), "--raise"), "--redirects", "3")
    logs, errors = {}, {}
    for name, run in runs.items():
        assert await run.wait() == 1
        assert run.status()["last_failure"]["exit_code"] == 1  # type: ignore[index]
        rank_dir = run.attempt_dir(0) / "0"
        logs[name] = (rank_dir / "stderr.log").read_text()
        errors[name] = json.loads((rank_dir / "error.json").read_text())
    threads = [report(out / name)["progress_thread"] for name, _ in OFF_AND_ON]
    assert threads == [False, True]
    assert logs["observed"] == logs["plain"]
    assert "Traceback (most recent call last):\n" in logs["observed"]  # after torch's warnings
    assert f'File "{PROBE}", line' in logs["observed"]
    assert logs["observed"].endswith("ValueError: probe failed on rank 0\n")
    assert "script_boot" not in logs["observed"]
    message = errors["observed"]["message"]
    assert message["message"] == errors["plain"]["message"]["message"]
    assert "ValueError: probe failed on rank 0" in message["message"]
    assert "script_boot" not in json.dumps(errors["observed"])


async def records_arrive(run: Serve) -> None:
    """The daemon received the rank's progress records (a record is no heartbeat)."""
    async with api_session(run) as (session, url, token):
        deadline = time.monotonic() + 60
        while (status := await live_status(session, url, token))["ipc"]["received"] < 1:
            assert time.monotonic() < deadline, status
            await asyncio.sleep(0.1)
    [rank] = status["ranks"]
    assert rank["last_heartbeat_age_s"] is None


async def live_status(session: aiohttp.ClientSession, url: str, token: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"}
    async with session.get(f"{url}/v1/status", headers=headers) as response:
        status: dict[str, Any] = await response.json()
    return status


def report(out: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / "report_r0.json").read_text())
    return data


async def test_a_binary_is_never_booted(serve: ServeFactory, tmp_path: Path) -> None:
    """--no-python's binary runs as given, even one whose command reads like a Python rank's."""
    out = tmp_path / "out"
    args = ("-u", str(PROBE), "--out", str(out))
    run = await serve(
        *SPAWN, "--no-python", script=sys.executable, script_args=args, env={"FTD_PROGRESS": "1"}
    )
    assert await run.wait() == 0
    plain = report(out / "test")
    assert plain["orig_argv"] == [sys.executable, *args]
    assert not plain["progress_thread"]
