"""Containment (issue 23, item 3): an error inside any part of the daemon ends at that part's
boundary. A test hook (FTD_INTERNAL_FAULT) raises inside each component in turn on a live
`ftd serve`: the daemon never ends with a traceback, says once what failed and where, and the
job goes on, or its attempt fails naming the component and the restart policy applies."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import pytest

from tests.conftest import BIN, ServeFactory

HEALTH = BIN / "health_worker.py"
BEATS = ("--mode", "ok", "--beats", "60", "--interval", "0.02")

# component -> (ftd serve flags, the worker's arguments, the job's exit code)
CASES: dict[str, tuple[tuple[str, ...], tuple[str, ...], int]] = {
    # A rank's first message is dropped (counted); the job goes on.
    "rank_messages": (("--max-restarts", "0"), BEATS, 0),
    # The first timer's work fails: that attempt fails naming the monitor; the next one runs.
    "monitor": (("--max-restarts", "1", "--ft-param-rank_heartbeat_timeout=0.5"), BEATS, 0),
    # A straggler check fails: it is said, and the next one runs (no attempt ends for it).
    "stragglers": (("--max-restarts", "0"), BEATS, 0),
    # The hang's stacks are not collected (a note); the hung rank is still killed, restarted.
    "hangs": (
        ("--max-restarts", "1", "--ft-param-rank_heartbeat_timeout=0.5"),
        ("--mode", "stop-heartbeats"),
        0,
    ),
    # Learning fails: the timeouts in force stay.
    "learning": (("--max-restarts", "0", "--ft-param-calc_timeouts=true"), BEATS, 0),
    # The failure summary fails: the reason alone is printed.
    "summary": (("--max-restarts", "0"), ("--mode", "workload"), 1),
    # A state file is not written; the API and the next write carry on.
    "persistence": (("--max-restarts", "0"), BEATS, 0),
    # One event is not journaled; it stays in the ring and the streams.
    "events": (("--max-restarts", "0"), BEATS, 0),
    # The attempt loop fails as the first outcome arrives: the attempt fails, is restarted.
    "attempt": (("--max-restarts", "1"), BEATS, 0),
}


@pytest.mark.parametrize("component", sorted(CASES))
async def test_an_error_in_a_component_is_contained(serve: ServeFactory, component: str) -> None:
    flags, worker, code = CASES[component]
    run = await serve(
        "--nproc-per-node", "2", *flags,
        script=HEALTH, script_args=worker, env={"FTD_INTERNAL_FAULT": component},
    )  # fmt: skip
    assert await run.wait() == code, run.stderr.text[-3000:]
    said = [line for line in run.stderr.lines if f"internal error in {component}" in line]
    assert said, f"the {component} fault was not said"
    assert "Traceback" not in run.stderr.text
    assert "supervision goes on" in said[0]
    if component in ("monitor", "attempt"):
        assert "restart 1/1" in run.stderr.text  # the policy applied as for any failure


async def test_a_failing_scrape_is_contained(serve: ServeFactory) -> None:
    run = await serve(
        "--nproc-per-node", "1", "--max-restarts", "0",
        script=HEALTH, script_args=("--mode", "relay", "--interval", "0.05"),
        env={"FTD_INTERNAL_FAULT": "metrics"},
    )  # fmt: skip
    line = await run.stderr.expect(r"API listening on (http://127\.0\.0\.1:\d+)")
    url = f"{line[1]}/metrics"

    def scrape() -> str:
        with urllib.request.urlopen(url, timeout=30) as response:
            return str(response.read().decode())

    first = await asyncio.to_thread(scrape)  # the injected error: this scrape is cut short
    assert 'ftd_internal_errors_total{component="metrics"} 1.0' in first
    second = await asyncio.to_thread(scrape)
    assert re.search(r"^ftd_attempt 0\.0$", second, re.M)
    assert "Traceback" not in run.stderr.text
    for pid in await run.rank_pids():
        import os
        import signal

        os.kill(pid, signal.SIGKILL)
    await run.wait()
