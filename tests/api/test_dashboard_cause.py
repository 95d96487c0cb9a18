"""Issue 44 items 1 and 7 on the page (headless Chromium against a live `ftd serve`): the final
picture of a job that failed for good names its exception, not only an exit code; a rank's
stderr that was never captured says where it went instead of a dead link; the stacks box belongs
to the failure shown and a newer failure clears it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.conftest import BIN, ServeFactory, await_api_event
from tests.support.truth_page import browser, in_chromium, open_page, shot

MISSING_FILE_RANK = BIN / "missing_file_rank.py"
TRUTH_RANK = BIN / "truth_rank.py"
EXCEPTION = "FileNotFoundError: [Errno 2] No such file or directory"
MISSING = "/nonexistent/ftd-issue-44/data.bin"
pytestmark = [pytest.mark.timeout(240)]


@in_chromium
async def test_the_final_page_names_the_exception(serve: ServeFactory, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    run = await serve(
        "--standalone",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "1",
        script=MISSING_FILE_RANK,
        script_args=(str(gate),),
    )
    url = (await run.stderr.expect(r"API listening on (http://\S+)"))[1]
    await run.stdout.expect("missing-file rank attempt 0 up")
    async with browser() as chromium:
        page, errors = await open_page(chromium, url)
        await page.locator("#stream-state", has_text="live").wait_for()
        Path(f"{gate}.0").touch()
        await run.stdout.expect("missing-file rank attempt 1 up")
        Path(f"{gate}.1").touch()
        assert await run.wait() == 1
        await page.locator("#state", has_text="FAILED").wait_for(timeout=30_000)
        final = page.locator("#final")
        await final.filter(has_text="FileNotFoundError").wait_for()
        assert MISSING in await final.inner_text()
        failure = await page.locator("#failure").inner_text()
        assert EXCEPTION in failure and MISSING in failure, failure
        await shot(page, tmp_path, "cause-final")
        assert errors == []


@in_chromium
async def test_the_stacks_box_belongs_to_the_failure_shown(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """A hang's stacks shown, then the job fails for good by another rank's exit: the box is
    cleared; that rank's stderr (no -r/-t) says it is on the terminal of `ftd serve`."""
    trigger = tmp_path / "fail-now"
    run = await serve(
        "--preload",
        "none",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--ft-param-rank_heartbeat_timeout=2",
        script=TRUTH_RANK,
        script_args=("--trigger", str(trigger)),
    )
    url = (await run.stderr.expect(r"API listening on (http://\S+)"))[1]
    pids = await run.rank_pids(0)
    for rank in (0, 1):
        await run.stdout.expect(f"truth rank {rank} attempt 0 up")
    os.kill(pids[1], signal.SIGSTOP)
    await await_api_event(url, "attempt_started", attempt=1, timeout=90)
    for rank in (0, 1):
        await run.stdout.expect(f"truth rank {rank} attempt 1 up")
    token = (run.run_dir / "api.token").read_text().strip()
    async with browser() as chromium:
        page, errors = await open_page(chromium, url)
        failure = page.locator("#failure")
        await failure.filter(has_text="hung").wait_for()
        await page.fill("#token", token)
        await page.click("#token-save")
        await failure.locator("button.show-stacks").click()
        box = page.locator("#cause-text")
        await box.filter(has_text="truth_rank.py").wait_for()
        trigger.touch()
        assert await run.wait() == 1
        await failure.filter(has_text="exit code 3").wait_for(timeout=30_000)
        await page.locator("#state", has_text="FAILED").wait_for()
        assert await box.is_hidden() and await box.inner_text() == ""
        assert "RuntimeError: boom 1" in await page.locator("#final").inner_text()
        await shot(page, tmp_path, "cause-box-cleared")
        assert errors == []


@in_chromium
async def test_uncaptured_stderr_says_where_it_went(serve: ServeFactory, tmp_path: Path) -> None:
    run = await serve(
        "--preload",
        "none",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        script=TRUTH_RANK,
        script_args=("--fail-until", "1"),
    )
    url = (await run.stderr.expect(r"API listening on (http://\S+)"))[1]
    await await_api_event(url, "attempt_started", attempt=1, timeout=90)
    token = (run.run_dir / "api.token").read_text().strip()
    async with browser() as chromium:
        page, errors = await open_page(chromium, url)
        await page.fill("#token", token)
        await page.click("#token-save")
        failure = page.locator("#failure")
        await failure.filter(has_text="exit code 3").wait_for()
        assert "RuntimeError: boom 0" in await failure.inner_text()
        await failure.locator("button.show-stderr").click()
        await page.locator("#cause-text", has_text="terminal of ftd serve").wait_for()
        button = failure.locator("button.show-stderr")
        assert "on the terminal of ftd serve" in await button.inner_text()
        assert await button.is_disabled()
        await shot(page, tmp_path, "cause-stderr-not-captured")
        assert [e for e in errors if "404" not in e] == []
    run.signal(signal.SIGTERM)
    await run.wait()
