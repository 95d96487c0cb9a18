"""Progress for the operator, end to end: a real `ftd serve` running an unmodified gloo DDP
script (tests/bin/plain_ddp.py: no ftd, no NVRx) whose rank 1 crashes once. One daemon run
shows its ranks' steps growing in GET /v1/status (held to openapi.yaml), the node's steps/s and
the time lost to the crash, the new /metrics series, `ftd status` and `ftd top`, and the
dashboard in a real headless Chromium."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BIN, ROOT, ServeFactory
from tests.support.api import api_of, cli, stop, until

CHROMIUM = os.environ.get("FTD_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
CRASH_AT = 100
SHOTS = ROOT / "runs" / "screenshots"

pytestmark = pytest.mark.timeout(300)


def steps(status: dict[str, Any]) -> list[int]:
    """Each rank's steps in this attempt (-1 before its first report)."""
    return [(rank["progress"] or {}).get("steps", -1) for rank in status["ranks"]]


def stepping(attempt: int, least: int) -> Callable[[dict[str, Any]], bool]:
    def ready(status: dict[str, Any]) -> bool:
        counts = steps(status)
        return status["attempt"] == attempt and bool(counts) and min(counts) >= least

    return ready


def accounted(status: dict[str, Any], read_at: float) -> dict[str, Any]:
    """The node's progress, its parts adding up to the wall time since the job began."""
    node: dict[str, Any] = status["progress"]
    assert node["since"] is not None and node["time_lost_s"] is not None, node
    ended = node["since"] + node["making_steps_s"] + node["time_lost_s"]
    assert abs(ended - read_at) < 5, (node, read_at)
    return node


async def test_steps_pace_and_time_lost_in_status_metrics_cli_and_dashboard(
    serve: ServeFactory, tmp_path: Path
) -> None:
    run = await serve(
        "--nproc-per-node", "2", "--max-restarts", "1",
        script=BIN / "plain_ddp.py",
        script_args=(
            "--steps", "100000", "--step-time", "0.05", "--ckpt-every", "10",
            "--crash-at-step", str(CRASH_AT), "--ckpt-dir", str(tmp_path / "ckpt"),
        ),
    )  # fmt: skip
    async with api_of(run) as api:
        # The first attempt: each rank's steps grow, the node makes steps at a pace.
        early = await until(api, "first steps", stepping(0, 3))
        later = await until(api, "more steps", lambda s: stepping(0, max(steps(early)) + 5)(s))
        assert all(a > b for a, b in zip(steps(later), steps(early), strict=True)), later
        for rank in later["ranks"]:
            progress = rank["progress"]
            assert progress["step_time_s"] is not None and progress["step_time_s"] >= 0.05
            assert progress["last_step_age_s"] is not None and progress["last_step_age_s"] < 30
            assert progress["collectives_entered"] > 0
        before = accounted(later, time.time())
        assert before["steps_per_s"] > 1 and before["steps"] == min(steps(later))
        # Rank 1 crashes at step CRASH_AT; the second attempt resumes from its checkpoint.
        await run.stderr.expect(rf"rank 1: crashing at step {CRASH_AT}", timeout=120)
        resumed = await until(  # a step time needs two of a rank's reports (the first may
            api,  # already count 5 steps on a busy machine)
            "steps, step times and a pace after the restart",
            lambda s: (
                stepping(1, 5)(s)
                and s["progress"]["steps_per_s"] > 0
                and all(r["progress"]["step_time_s"] is not None for r in s["ranks"])
            ),
        )
        assert resumed["last_failure"]["kind"] == "exit", resumed["last_failure"]
        after = accounted(resumed, time.time())
        assert after["steps_per_s"] > 1
        assert after["since"] == before["since"]  # the job began once
        # The first attempt's steps were kept, the crash and the restart were lost.
        assert after["making_steps_s"] > before["making_steps_s"]
        assert after["time_lost_s"] > before["time_lost_s"] > 0, (before, after)

        _, metrics, _ = await api.call("GET", "/metrics")
        lines = metrics.splitlines()
        for series in (
            'ftd_rank_steps{local_rank="0"}',
            'ftd_rank_steps{local_rank="1"}',
            'ftd_rank_step_seconds{local_rank="1"}',
            'ftd_rank_last_step_timestamp_seconds{local_rank="0"}',
            'ftd_rank_collectives_entered{local_rank="1"}',
            "ftd_node_steps_per_second",
            "ftd_making_steps_seconds",
            "ftd_time_lost_seconds",
            "ftd_job_start_timestamp_seconds",
        ):
            assert any(line.startswith(f"{series} ") for line in lines), series
        [lost] = [line for line in lines if line.startswith("ftd_time_lost_seconds ")]
        assert float(lost.split()[1]) >= after["time_lost_s"]

        for command in (("status", "--url", api.url), ("top", "--once", "--url", api.url)):
            done = cli(*command)
            assert done.returncode == 0, done.stderr
            assert "steps/s, making steps" in done.stdout and "time lost" in done.stdout
            header = next(line for line in done.stdout.splitlines() if line.startswith("LOCAL"))
            assert header.split()[-4:] == ["STEPS", "STEP", "TIME", "STRAGGLER"], header

        await _dashboard_shows_progress(api.url)
        assert await stop(run) == 128 + signal.SIGTERM


async def _dashboard_shows_progress(url: str) -> None:
    try:
        from playwright.async_api import async_playwright
    except ImportError:  # pragma: no cover - the test extra installs it
        pytest.skip("playwright is not installed")
    if shutil.which(CHROMIUM) is None:
        pytest.skip(f"no Chromium at {CHROMIUM}")
    async with async_playwright() as playwright:
        chromium = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await chromium.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            await page.goto(url + "/")
            await page.wait_for_function(
                "() => [...document.querySelectorAll('#ranks tbody td.steps')]"
                ".filter(c => Number(c.textContent) > 0).length === 2"
            )
            times = await page.locator("#ranks tbody td.step-time").all_inner_texts()
            assert all(t.endswith(("ms", " s")) for t in times), times
            await page.locator("#facts", has_text="steps/s").wait_for()
            facts = await page.locator("#facts").inner_text()
            assert "time lost" in facts and "steps/s 0.00" not in facts, facts
            assert errors == []
            SHOTS.mkdir(parents=True, exist_ok=True)
            await page.screenshot(path=str(SHOTS / "dashboard-progress.png"), full_page=True)
        finally:
            await chromium.close()
