"""A hang building up is visible before its verdict (issue 44, item 6): a live `ftd serve`
whose rank makes optimizer steps, then none (tests/bin/stall_rank.py). GET /v1/status (held
to openapi.yaml) shows the progress deadline in force and each rank's growing age against it,
`ftd status` and `ftd top` print them, and in a real headless Chromium the page's "timeouts in
force" names the progress deadline and the rank's age cell turns amber, then red, before the
verdict."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from ftd.text import duration
from tests.conftest import BIN, Serve, ServeFactory
from tests.support.api import api_of, cli, until
from tests.support.truth_page import browser, in_chromium, open_page, shot

STALL_RANK = BIN / "stall_rank.py"
FLOOR_S = 10.0
pytestmark = pytest.mark.timeout(240)


async def start(serve: ServeFactory, stop_file: Path) -> Serve:
    flags = ("--nproc-per-node", "1", "--max-restarts", "0")
    return await serve(
        *flags,
        "--progress-timeout-floor",
        str(FLOOR_S),
        script=STALL_RANK,
        script_args=("--stop-file", str(stop_file)),
    )


def rank_progress(status: dict[str, Any]) -> dict[str, Any]:
    ranks = status["ranks"]
    return (ranks[0]["progress"] or {}) if ranks else {}


def timed(status: dict[str, Any]) -> bool:
    """The rank made steps: its time without progress is counted against the deadline."""
    return isinstance(rank_progress(status).get("progress_deadline_age_s"), float | int)


async def stalled(run: Serve, stop_file: Path) -> None:
    stop_file.touch()
    await run.stdout.expect(r"stall_rank: stalled at step \d+", timeout=60)


async def test_status_cli_and_top_show_the_deadline_and_the_age_growing_against_it(
    serve: ServeFactory, tmp_path: Path
) -> None:
    stop_file = tmp_path / "stop"
    run = await start(serve, stop_file)
    async with api_of(run) as api:
        await run.stdout.expect("stall_rank: stepping", timeout=120)
        moving = await until(api, "the rank timed", timed, timeout=60)
        await stalled(run, stop_file)
        first = await until(
            api, "an age", lambda s: rank_progress(s).get("progress_deadline_age_s", 0) >= 1
        )
        deadlines = first["progress_deadlines"]
        assert deadlines["enabled"] is True and deadlines["floor_s"] == FLOOR_S, deadlines
        limit = deadlines["deadline_s"]
        assert limit >= FLOOR_S
        progress = rank_progress(first)
        assert progress["progress_deadline_s"] == limit, progress
        assert progress["progress_deadline_name"] == "progress", progress
        assert rank_progress(moving)["progress_deadline_age_s"] < limit
        age = progress["progress_deadline_age_s"]
        later = await until(
            api, "a growing age", lambda s: rank_progress(s)["progress_deadline_age_s"] > age + 1
        )
        assert rank_progress(later)["progress_deadline_age_s"] < limit, later
        cell = re.compile(rf"\d\S* m?s / {re.escape(duration(limit))}(\s|$)")
        for command in (("status", "--url", api.url), ("top", "--once", "--url", api.url)):
            done = cli(*command)
            assert done.returncode == 0, done.stderr
            lines = done.stdout.splitlines()
            header = next(i for i, line in enumerate(lines) if line.startswith("LOCAL"))
            assert "NO PROGRESS" in lines[header], lines[header]
            assert cell.search(lines[header + 1]), (lines[header + 1], duration(limit))
            timeouts = next(line for line in lines if line.startswith("timeouts: "))
            assert timeouts.endswith(f"progress={limit:g}"), timeouts
        assert await run.wait(timeout=120) == 1  # the verdict: no restarts left
    [hung] = run.event_data("rank_hung")
    assert f"progress deadline {limit:g}s" in hung["reason"], hung


# Every class a progress-age cell was seen with, in order (the page replaces its rows at each
# poll and ticks the ages every 250 ms): amber then red must both be seen before the verdict.
RECORD_CLASSES = """() => {
  window.__seen = [];
  const sample = () => {
    for (const cell of document.querySelectorAll('#ranks td.progress-age')) {
      const mark = cell.classList.contains('stale') ? 'red'
        : cell.classList.contains('near') ? 'amber' : 'plain';
      if (window.__seen[window.__seen.length - 1] !== mark) window.__seen.push(mark);
      if (mark === 'red' && !window.__redAt) window.__redAt = Date.now() / 1000;
    }
  };
  new MutationObserver(sample).observe(document.body, {subtree: true, childList: true,
    attributes: true, attributeFilter: ['class']});
}"""


@in_chromium
async def test_the_page_names_the_progress_deadline_and_the_age_turns_amber_then_red(
    serve: ServeFactory, tmp_path: Path
) -> None:
    stop_file = tmp_path / "stop"
    run = await start(serve, stop_file)
    async with api_of(run) as api, browser() as chromium:
        page, errors = await open_page(chromium, api.url)
        await run.stdout.expect("stall_rank: stepping", timeout=120)
        status = await until(api, "the rank timed", timed, timeout=60)
        limit = status["progress_deadlines"]["deadline_s"]
        await page.locator(
            "#timeouts .progress-deadline", has_text=f"progress {limit:g}"
        ).wait_for()
        await page.wait_for_function(
            "() => /\\/ /.test(document.querySelector('#ranks td.progress-age')?.textContent)"
        )
        text = await page.locator("#ranks td.progress-age").inner_text()
        assert text.endswith(f" / {duration(limit)}"), text
        await page.evaluate(RECORD_CLASSES)
        await stalled(run, stop_file)
        await page.wait_for_function("() => window.__seen.includes('red')", timeout=60_000)
        seen = await page.evaluate("() => window.__seen")
        assert "amber" in seen and seen.index("amber") < seen.index("red"), seen
        red_at = await page.evaluate("() => window.__redAt")
        await shot(page, tmp_path, "hang-building-up")
        assert errors == []
        assert await run.wait(timeout=120) == 1
    [hung] = run.events("rank_hung")
    assert red_at < hung["time"], (red_at, hung)  # shown before the verdict, not after it
