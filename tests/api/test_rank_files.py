"""Operator truth (issue 27), the daemon's side: a recovery's detect runs from the rank's last
sign of life, the crash-loop back-off is its own stage, the root exception is in the status, and
a rank's stacks and stderr are read through the API (`GET /v1/ranks/{global_rank}/stacks`,
`/stderr`) with their refusals: path-like ranks, huge sizes, no token where reads need one."""

from __future__ import annotations

import json
import os
import re
import signal
from typing import Any

import aiohttp
import pytest

from ftd.supervision.recovery import STAGES
from tests.conftest import BIN, ServeFactory, await_api_event

RANK = BIN / "truth_rank.py"
TOKEN = "truth-token-0123456789abcdef"
pytestmark = [pytest.mark.timeout(240)]


def serve_flags(*flags: str) -> tuple[str, ...]:
    return ("--preload", "none", "--standalone", "--nproc-per-node", "2", *flags)


async def test_detect_runs_from_the_last_sign_of_life(serve: ServeFactory) -> None:
    """Row 4: a SIGSTOPped rank silent 3 s shows detect ≈ 3 s, not the milliseconds between
    its resumption for stacks and the kill."""
    run = await serve(
        *serve_flags("--max-restarts", "1", "--ft-param-rank_heartbeat_timeout=3"), script=RANK
    )
    url = (await run.stderr.expect(r"API listening on (http://\S+)"))[1]
    pids = await run.rank_pids(0)
    for rank in (0, 1):
        await run.stdout.expect(f"truth rank {rank} attempt 0 up")
    os.kill(pids[1], signal.SIGSTOP)
    recovery = await await_api_event(url, "recovery", timeout=90)
    data: Any = recovery["data"]
    assert 2.5 <= data["stages"]["detect"] <= 30, data
    run.signal(signal.SIGTERM)
    await run.wait()


async def test_rank_files_exception_backoff_stage_and_refusals(serve: ServeFactory) -> None:
    """Row 9, row 4: the root exception in the status; stacks and stderr through the API
    (text/plain, nosniff, bounded, escaped; 404 problem for an unknown rank or file, 400 for
    a bad size or rank; 401 without the token where reads need it); the back-off is its own
    stage, not part of the rendezvous."""
    run = await serve(
        *serve_flags("--max-restarts", "2", "--restart-backoff", "2:4", "--redirects", "2"),
        "--api-host", "0.0.0.0",
        script=RANK, script_args=("--fail-until", "2"), env={"FTD_API_TOKEN": TOKEN},
    )  # fmt: skip
    url = (await run.stderr.expect(r"API listening on (http://\S+)"))[1]
    url = re.sub(r"//[^:/]+", "//127.0.0.1", url)
    recovery = await await_api_event(url, "recovery", timeout=90, token=TOKEN, attempt=2)
    stages: Any = recovery["data"]["stages"]
    assert list(stages) == list(STAGES)
    assert 1.5 <= stages["backoff"] <= 10 and stages["rendezvous"] < 1.5, stages
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession() as session:

        async def get(path: str, headers: dict[str, str] | None = auth) -> tuple[int, str, Any]:
            async with session.get(url + path, headers=headers) as r:
                return r.status, r.content_type, (r.headers, await r.text())

        status, _, (_, body) = await get("/v1/status")
        failure = json.loads(body)["last_failure"]
        assert failure["exception"] == "RuntimeError: boom 1", failure
        assert json.loads(body)["policy"]["multi_node"] is False
        status, kind, (headers, text) = await get("/v1/ranks/1/stderr?attempt=1")
        assert status == 200 and kind == "text/plain", text
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert "RuntimeError: boom 1" in text
        status, _, (_, text) = await get("/v1/ranks/1/stderr?attempt=1&tail_bytes=8")
        assert status == 200 and len(text.encode()) <= 8 and text.endswith("1\n"), text
        for path, code in [
            ("/v1/ranks/1/stderr?tail_bytes=1000000000", 400),
            ("/v1/ranks/1/stderr?tail_bytes=0", 400),
            ("/v1/ranks/1/stderr?tail_bytes=-5", 400),
            ("/v1/ranks/1/stderr?tail_bytes=1e3", 400),
            ("/v1/ranks/1/stderr?tail_bytes=1&tail_bytes=2", 400),
            ("/v1/ranks/-1/stacks", 400),
            ("/v1/ranks/1x/stacks", 400),
            ("/v1/ranks/%2E%2E%2Fapi.token/stacks", (400, 404)),
            ("/v1/ranks/..%2F..%2Fapi.token/stderr", (400, 404)),
            ("/v1/ranks/1%00/stacks", 400),
            ("/v1/ranks/99999999999/stacks", 400),
            ("/v1/ranks/7/stacks", 404),
            ("/v1/ranks/1/stacks?attempt=99", 404),
            ("/v1/ranks/1/stacks?attempt=0", 404),  # it exited: no stacks were written
            ("/v1/ranks/0/stderr?attempt=2&tail_bytes=65536", 200),
        ]:
            status, kind, (_, text) = await get(path)
            assert status in (code if isinstance(code, tuple) else (code,)), (path, status, text)
            if status != 200:
                assert kind == "application/problem+json", (path, kind)
                assert TOKEN not in text
        status, _, _ = await get("/v1/ranks/1/stderr?attempt=1", headers=None)
        assert status == 401
        status, _, _ = await get("/v1/ranks/1/stderr?attempt=1", headers={"Authorization": "x"})
        assert status == 401
    run.signal(signal.SIGTERM)
    await run.wait()
