"""Operator truth (issue 27): the dashboard's last picture is the true one, its numbers are true,
the cause is one click away (the daemon's side: tests/test_rank_files.py).

The page runs in a real headless Chromium (Debian's `chromium`, driven by Playwright) against a
live `ftd serve` or a stub API (real aiohttp on 127.0.0.1). Screenshots go to the directory
FTD_TEST_SHOTS names, else to `<pytest tmp dir>/screenshots/` of each test (printed with -s).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from ftd.text import duration
from tests.conftest import BIN, ServeFactory, await_api_event
from tests.support.truth_page import (
    DASH,
    Stub,
    browser,
    in_chromium,
    open_page,
    shot,
    stub_server,
    stub_status,
)

RANK = BIN / "truth_rank.py"
pytestmark = [pytest.mark.timeout(240)]


# -- the page against the stub -----------------------------------------------------------------

DURATIONS = [
    (None, DASH),
    (0.0004, "<1 ms"),
    (0.0123, "12 ms"),
    (0.9994, "999 ms"),
    (0.9996, "1.00 s"),
    (1.04, "1.04 s"),
    (9.996, "10.0 s"),
    (59.94, "59.9 s"),
    (59.9996, "1 min 0 s"),
    (119.6, "2 min 0 s"),
    (3599.6, "1 h 0 min"),
    (5400, "1 h 30 min"),
    (86399.9, "1 d 0 h"),
    (86400, "1 d 0 h"),
    (90000, "1 d 1 h"),
]
EDGE_DURATIONS = [
    0, 0.0004999, 0.0005, 0.9994999, 0.9995, 1.0, 9.994999, 9.995, 59.94999, 59.95, 59.5,
    3599.49, 3599.5, 86369.9, 86370, 86399.9, -1.5, 10**10, 123456.789, 0.25, 2.675, 1e-9,
]  # fmt: skip


@in_chromium
async def test_one_duration_formatter() -> None:
    """Row 5: 0.9996 s is "1.00 s" (never "1000 ms"), 59.9996 s never "60 s" inside minutes,
    a day "1 d 0 h" (never "1440 min"), null a dash; and the page's formatter is the CLI's
    (ftd.text.duration) on every value, carries and edges included."""
    async with stub_server(Stub(stub_status())) as url, browser() as chromium:
        page, errors = await open_page(chromium, url)
        await page.wait_for_function("() => window.__ftd && window.__ftd.duration")
        shown = await page.evaluate(
            "values => values.map(v => window.__ftd.duration(v))", [v for v, _ in DURATIONS]
        )
        assert shown == [text for _, text in DURATIONS]
        twins = await page.evaluate(
            "values => values.map(v => window.__ftd.duration(v))", EDGE_DURATIONS
        )
        assert twins == [duration(v) for v in EDGE_DURATIONS]
        assert errors == []


@in_chromium
async def test_recovery_rows_null_backoff_and_scale(tmp_path: Path) -> None:
    """Row 4: null init/total_s are a dash (not "0 ms"); the back-off is its own stage; the
    stage bars are to scale (a 4 ms detect is not as wide as a 2 s stop); restore and redo,
    which apply only where a snapshot was restored, are left out when null."""
    stub = Stub(stub_status())
    now = time.time()
    stub.event("attempt_started", now - 30, attempt=0, pids={})
    stub.event("attempt_started", now - 20, attempt=1, pids={})
    stages = {"detect": 0.004, "stop": 2.0, "backoff": 8.0, "rendezvous": 0.03, "spawn": 0.1}
    stub.event(
        "recovery", now - 10, attempt=1, round=1, cause="rank 1 exited with exit code 3",
        stages={**stages, "init": None, "restore": None, "redo": None}, total_s=None,
        failure_time=now - 31,
    )  # fmt: skip
    async with stub_server(stub) as url, browser() as chromium:
        page, errors = await open_page(chromium, url)
        row = page.locator('.recovery[data-attempt="1"]')
        await row.wait_for()
        assert await row.locator(".total").inner_text() == DASH
        caption = await row.locator(".stage-values").inner_text()
        assert f"init {DASH}" in caption and not re.search(r"\b0 ms", caption), caption
        assert "restore" not in caption and "redo" not in caption, caption
        assert "backoff 8.00 s" in caption and "rendezvous 30 ms" in caption, caption
        assert await row.locator(".stage-init").count() == 0
        widths = await stage_widths(row, stages)
        assert widths["detect"] < widths["stop"] / 10, widths
        assert widths["backoff"] == pytest.approx(4 * widths["stop"], rel=0.1), widths
        await shot(page, tmp_path, "truth-recovery-rows")
        assert errors == []


async def stage_widths(row: Any, stages: dict[str, float]) -> dict[str, float]:
    """Each stage bar's width once every bar is laid out: the page may be re-rendering the row
    (a status poll) when it is first measured, and a bar between renders has no box."""
    for _ in range(100):
        boxes = {name: await row.locator(f".stage-{name}").bounding_box() for name in stages}
        if all(box is not None and box["width"] > 0 for box in boxes.values()):
            return {name: box["width"] for name, box in boxes.items() if box is not None}
        await asyncio.sleep(0.05)
    raise AssertionError(f"stage bars not laid out: {boxes}")


@in_chromium
async def test_attention_deadlines_backoff_history_and_no_exclude_on_one_node(
    tmp_path: Path,
) -> None:
    """Row 8, row 14: heartbeat ages against the deadline (amber past 70 %, red past 100 %);
    a back-off counts down; failed attempts per node and hangs per rank; no exclude form on a
    single node (and one where the status says multi-node)."""
    now = time.time()
    memory = {"newest_step": 60, "steps_lost": 1, "memory_bytes": 1, "budget_bytes": 2,
              "replica_lag_steps": 2, "replica": {"successor": "node-b"}}  # fmt: skip
    stub = Stub(stub_status(state="restarting", backoff_s=30.0, checkpoint=memory))
    stub.event("attempt_started", now - 40, attempt=0, pids={})
    for attempt in (0, 1):
        stub.event("rank_hung", now - 30 + attempt, global_rank=2, reason="no heartbeat")
        stub.event(
            "attempt_failed", now - 30 + attempt, attempt=attempt,
            failure={"kind": "hang", "reason": "rank 2 hung; Python stacks in /x/stacks.txt"},
        )  # fmt: skip
    stub.event("restart_backoff", now, attempt=1, delay_s=30.0, fast_failures=2)
    timeouts = stub_status()["timeouts"]
    stub.event("timeouts_changed", now, by="a", timeouts=timeouts)
    stub.event("timeouts_changed", now, by="b", timeouts={**timeouts, "rank_heartbeat_timeout": 3})
    async with stub_server(stub) as url, browser() as chromium:
        page, errors = await open_page(chromium, url)
        await page.locator("#ranks tbody tr").nth(2).wait_for()
        ages = page.locator("#ranks td.age.heartbeat")
        await page.wait_for_function(
            "() => document.querySelectorAll('#ranks td.age.heartbeat.stale').length >= 1"
        )
        assert "near" not in (await ages.nth(0).get_attribute("class") or "")
        assert "near" in (await ages.nth(1).get_attribute("class") or "")  # 3.6 s of 5 s
        assert "stale" in (await ages.nth(2).get_attribute("class") or "")  # 6 s of 5 s
        backoff = page.locator("#backoff")
        await backoff.filter(has_text="next attempt in").wait_for()
        first = await backoff.inner_text()
        await page.wait_for_function(
            "first => document.querySelector('#backoff').textContent !== first", arg=first
        )
        assert re.search(r"next attempt in (2\d|30)\.\d s", first), first
        history = await page.locator("#history").inner_text()
        assert "node node-a: 2 failed attempts" in history and "rank 2: 2 hangs" in history
        events = await page.locator("#events li.k-attempt_failed").first.inner_text()
        assert "stacks=/x/stacks.txt" in events
        change = await page.locator("#events li.k-timeouts_changed").first.inner_text()
        assert "by=b rank_heartbeat_timeout 5 → 3" in change, change
        facts = await page.locator("#facts").inner_text()  # the memory tier's
        assert "snapshot step 60" in facts and "steps lost 1" in facts, facts
        assert "replica node-b · 2 steps behind" in facts, facts
        assert await page.locator("#exclude-form").is_hidden()
        assert await page.locator("#exclude-note").is_visible()
        await shot(page, tmp_path, "truth-attention")
        stub.status = stub_status(policy={**stub_status()["policy"], "multi_node": True})
        await page.locator("#exclude-form").wait_for(state="visible")
        assert errors == []


@in_chromium
async def test_a_daemon_that_stops_answering_is_its_last_known_state(tmp_path: Path) -> None:
    """Item 1: without a `daemon_stopped`, a daemon gone silent is not shown green: its last
    state, greyed and marked as last known."""
    async with browser() as chromium:
        async with stub_server(Stub(stub_status())) as url:
            page, errors = await open_page(chromium, url)
            await page.locator(".tile.self.s-running").wait_for()
        await page.locator("#final", has_text="last known state").wait_for()
        assert await page.locator("#state").inner_text() == "RUNNING?"  # CSS upper-cases it
        for badge in (page.locator("#state"), page.locator(".tile.self")):
            assert "s-running" not in (await badge.get_attribute("class") or "")
        await shot(page, tmp_path, "truth-unreachable")
        assert errors == []


def serve_flags(*flags: str) -> tuple[str, ...]:
    return ("--preload", "none", "--standalone", "--nproc-per-node", "2", *flags)


# -- the page against a live daemon ------------------------------------------------------------


@in_chromium
async def test_a_failed_job_stays_failed_after_its_daemon_exits(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """Row 1, done-when: --max-restarts 0, a rank exits 3, the daemon exits; 10 s later the
    badge says FAILED, the last failure names exit code 3, tile and ranks agree."""
    trigger = tmp_path / "fail-now"
    run = await serve(
        *serve_flags("--max-restarts", "0"), script=RANK, script_args=("--trigger", str(trigger))
    )
    url = (await run.stderr.expect(r"API listening on (http://\S+)"))[1]
    await await_api_event(url, "state_changed", state="running")
    async with browser() as chromium:
        page, errors = await open_page(chromium, url)
        await page.locator("#stream-state", has_text="live").wait_for()
        await page.locator(".tile.self.s-running").wait_for()
        await shot(page, tmp_path, "truth-running")
        trigger.touch()
        assert await run.wait() == 1
        await asyncio.sleep(10)  # the done-when: what the page says 10 s after the daemon left
        assert await page.locator("#state").inner_text() == "FAILED"
        final = await page.locator("#final").inner_text()
        assert "exit code 3" in final, final
        assert await page.locator(".tile.self").get_attribute("data-state") == "failed"
        states = await page.locator("#ranks tbody td.state").all_inner_texts()
        assert "running" not in states and "failed" in states, states
        assert "exit code 3" in await page.locator("#failure").inner_text()
        await shot(page, tmp_path, "truth-failed-daemon-gone")
        assert errors == []


SAMPLE = """() => {
  window.__samples = [];
  const sample = () => {
    const badge = document.querySelector('#state').textContent;
    const tile = document.querySelector('.tile.self');
    const ranks = document.querySelector('#ranks-summary').textContent;
    if (tile) window.__samples.push({badge, tile: tile.dataset.state,
      up: tile.textContent.match(/(\\d+\\/\\d+) up/)?.[1], ranks: ranks.split(' ')[0]});
  };
  new MutationObserver(sample).observe(document.body, {subtree: true, childList: true,
    characterData: true, attributes: true});
}"""


@in_chromium
async def test_a_restart_shows_one_state_in_header_tile_and_ranks(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """Row 3: every picture the page draws during a restart has header, tile and ranks from
    one snapshot (never RESTARTING beside a tile "running 2/2 up")."""
    run = await serve(*serve_flags("--max-restarts", "3"), script=RANK, script_args=(
        "--slow-stop", "2.5"))  # fmt: skip
    url = (await run.stderr.expect(r"API listening on (http://\S+)"))[1]
    await await_api_event(url, "state_changed", state="running")
    token = (run.run_dir / "api.token").read_text().strip()
    async with browser() as chromium:
        page, errors = await open_page(chromium, url)
        await page.locator(".tile.self.s-running").wait_for()
        await page.evaluate(SAMPLE)
        async with aiohttp.ClientSession() as session:
            headers = {"Authorization": f"Bearer {token}"}
            body = {"count": False, "reason": "truth test"}
            async with session.post(f"{url}/v1/restart", json=body, headers=headers) as r:
                assert r.status == 202
        await page.locator("#state", has_text="restarting").wait_for(timeout=30_000)
        await shot(page, tmp_path, "truth-restarting")
        await await_api_event(url, "attempt_started", attempt=1)
        await page.locator(".tile.self.s-running").wait_for()
        await page.wait_for_function(
            "() => document.querySelector('#ranks-summary').textContent.startsWith('2/2')"
        )
        await shot(page, tmp_path, "truth-restarted")
        samples = await page.evaluate("window.__samples")
        assert any(s["badge"] == "restarting" for s in samples), samples
        mixed = [s for s in samples if s["badge"] != s["tile"] or s["up"] != s["ranks"]]
        assert not mixed, mixed[:5]
        assert errors == []
    run.signal(signal.SIGTERM)
    await run.wait()


@in_chromium
async def test_stacks_of_a_hung_rank_one_click_away(serve: ServeFactory, tmp_path: Path) -> None:
    """Row 9, item 2: a hung rank's last failure shows in the page with its stacks one click
    away (read through the API, shown as text)."""
    run = await serve(
        *serve_flags("--max-restarts", "1", "--ft-param-rank_heartbeat_timeout=2"), script=RANK
    )
    url = (await run.stderr.expect(r"API listening on (http://\S+)"))[1]
    pids = await run.rank_pids(0)
    for rank in (0, 1):
        await run.stdout.expect(f"truth rank {rank} attempt 0 up")
    os.kill(pids[1], signal.SIGSTOP)
    await await_api_event(url, "attempt_started", attempt=1, timeout=90)
    stacks = f"{url}/v1/ranks/1/stacks?attempt=0"
    token = (run.run_dir / "api.token").read_text().strip()
    async with aiohttp.ClientSession() as session:
        async with session.get(stacks) as r:
            assert r.status == 401  # a privileged read, on loopback too (issue row 2)
        async with session.get(stacks, headers={"Authorization": f"Bearer {token}"}) as r:
            assert r.status == 200 and r.content_type == "text/plain"
            assert "truth_rank.py" in await r.text()
    async with browser() as chromium:
        page, errors = await open_page(chromium, url)
        failure = page.locator("#failure")
        await failure.filter(has_text="hung").wait_for()
        await page.fill("#token", token)  # the header's token serves these reads too
        await page.click("#token-save")
        await failure.locator("button.show-stacks").click()
        await page.locator("#cause-text", has_text="truth_rank.py").wait_for()
        assert "attempt 0" in await page.locator("#cause-text").inner_text()
        await shot(page, tmp_path, "truth-stacks")
        assert errors == []
    run.signal(signal.SIGTERM)
    await run.wait()


@in_chromium
async def test_a_ranks_stderr_asks_for_the_token_then_shows(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """Issue row 2: a rank's stderr is a privileged read on loopback too. Its box answers the
    401 with a small form asking for the token (from <run dir>/api.token), keeps the token in
    the tab's sessionStorage, reads again with it in the Authorization header (never in a URL)
    and shows the text."""
    run = await serve(
        *serve_flags("--max-restarts", "1", "--redirects", "2"),
        script=RANK,
        script_args=("--fail-until", "1"),
    )
    url = (await run.stderr.expect(r"API listening on (http://\S+)"))[1]
    await await_api_event(url, "attempt_started", attempt=1, timeout=90)
    token = (run.run_dir / "api.token").read_text().strip()
    async with browser() as chromium:
        page, errors = await open_page(chromium, url)
        requested: list[str] = []
        page.on("request", lambda request: requested.append(request.url))
        failure = page.locator("#failure")
        await failure.filter(has_text="exit code 3").wait_for()
        await failure.locator("button.show-stderr").click()
        form = page.locator("#cause-token")
        await form.wait_for()
        assert "api.token" in await form.inner_text()
        assert "only with the API token" in await page.locator("#cause-text").inner_text()
        await shot(page, tmp_path, "truth-stderr-asks-token")
        await page.fill("#cause-token-input", token)
        await form.locator("button[type=submit]").click()
        await page.locator("#cause-text", has_text="RuntimeError: boom 0").wait_for()
        assert "attempt 0" in await page.locator("#cause-text").inner_text()
        assert await form.is_hidden()
        assert await page.evaluate("sessionStorage.getItem('ftd-token')") == token
        assert "token set" in await page.locator("#token-state").inner_text()
        assert not [address for address in requested if token in address]
        await shot(page, tmp_path, "truth-stderr-shown")
        assert errors == []
    run.signal(signal.SIGTERM)
    await run.wait()


@in_chromium
async def test_restarts_are_counted_one_way_and_labelled() -> None:
    """Row 7: the header's "restarts used 1/3" (charged to --max-restarts, the CLI's count) and
    the timeline's three restarts no longer disagree unexplained: the timeline says how many
    of its restarts were counted."""
    now = time.time()
    stub = Stub(stub_status(restart_count=1))
    for attempt in range(4):
        stub.event("attempt_started", now - 40 + 10 * attempt, attempt=attempt, pids={})
    async with stub_server(stub) as url, browser() as chromium:
        page, errors = await open_page(chromium, url)
        summary = page.locator("#timeline-summary")
        await summary.filter(has_text="3 restarts").wait_for()
        assert "(1 counted against --max-restarts)" in await summary.inner_text()
        facts = await page.locator("#facts").inner_text()
        assert "restarts used 1/3" in facts, facts
        assert errors == []
