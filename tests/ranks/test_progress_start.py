"""ftd's rank start observes an unmodified script's progress unless `--progress off` (zygote
ranks through rank_main, spawn ranks through script_boot.py), and the daemon takes the records
without a refusal and without treating them as life."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import BIN, ServeFactory
from tests.support.checks import api_session

PROBE = BIN / "progress_probe.py"


@pytest.mark.parametrize(
    ("start_method", "flags", "observed"),
    [
        ("zygote", (), True),
        ("zygote", ("--progress", "off"), False),
        ("spawn", (), True),
        ("spawn", ("--progress", "off"), False),
    ],
)
async def test_progress_is_observed_only_when_asked_for(
    serve: ServeFactory, tmp_path: Path, start_method: str, flags: tuple[str, ...], observed: bool
) -> None:
    release = tmp_path / "release"
    run = await serve(
        "--start-method",
        start_method,
        "--nproc-per-node",
        "1",
        *flags,
        script=PROBE,
        script_args=(str(release),),
    )
    await run.stdout.expect(f"progress thread {observed}")
    await run.stdout.expect(f"torch hooked {observed}")
    if observed:  # records arrive (steps moved, then keep-alives) and none is refused
        async with api_session(run) as (session, url, token):
            deadline = time.monotonic() + 60
            while (status := await live_status(session, url, token))["ipc"]["received"] < 3:
                assert time.monotonic() < deadline, status
                await asyncio.sleep(0.1)
        [rank] = status["ranks"]
        assert rank["last_heartbeat_age_s"] is None  # a record is no heartbeat
    release.touch()
    assert await run.wait() == 0
    assert run.status()["ipc"]["dropped"] == {}  # type: ignore[index]
    assert not run.events("rank_hung")


async def live_status(session: aiohttp.ClientSession, url: str, token: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"}
    async with session.get(f"{url}/v1/status", headers=headers) as response:
        status: dict[str, Any] = await response.json()
    return status
