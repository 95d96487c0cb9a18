"""Stragglers of an unmodified DDP script (tests/bin/plain_ddp.py: no ftd, no NVRx): rank 1's
model forward sleeps 60 ms more every step, or its batches come 80 ms late, so every rank's step
takes as long, and only its forward times, or its host times between steps, tell
(ftd/health/stragglers.py)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from ftd.cli.cluster_lines import SIGNAL_WORDS
from ftd.health.stragglers import SUSTAIN_S
from ftd.text import NO_VALUE
from tests.conftest import BIN, ServeFactory
from tests.support.api import Api, api_of, cli, stop
from tests.support.truth_page import CHROMIUM, async_playwright, browser, open_page

PLAIN_DDP = BIN / "plain_ddp.py"
STRAGGLING = ("--steps", "100000", "--ckpt-every", "100000", "--step-time", "0.01")
SLOW_RANK_1 = ("--slow-forward-rank", "1", "--slow-forward-ms", "60")
SLOW_DATA_1 = ("--slow-data-rank", "1", "--slow-data-ms", "80")


async def test_a_rank_whose_forward_is_60ms_slower_is_named_a_straggler(
    serve: ServeFactory, tmp_path: Path
) -> None:
    run = await serve(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        script=PLAIN_DDP,
        script_args=(*STRAGGLING, *SLOW_RANK_1, "--ckpt-dir", str(tmp_path / "c")),
    )
    async with api_of(run) as api:
        await run.stderr.expect(r"straggler: rank 1's forward pass takes", timeout=120)
        [event] = run.events("straggler")
        data = event["data"]
        assert data["global_rank"] == 1 and data["node_id"], data
        assert data["ratio"] >= 1.2 and data["forward_s"] - data["median_s"] >= 0.05, data
        # named within 30 s of being seen slow (both ranks' forward times reported)
        assert SUSTAIN_S - 0.01 <= event["time"] - data["since"] < 30, (event, data)
        code, status, _ = await api.call("GET", "/v1/status")
        assert code == 200
        progress = {r["global_rank"]: r["progress"] for r in status["ranks"]}
        assert progress[1]["straggler"]["since"] == data["since"], progress
        assert progress[0]["straggler"] is None, progress
        code, cluster, _ = await api.call("GET", "/v1/cluster")
        assert code == 200
        [named] = cluster["stragglers"]
        assert named["global_rank"] == 1 and named["ratio"] >= 1.2, cluster
        await marked_everywhere(api, "forward")
    await stop(run)
    assert [e["data"]["global_rank"] for e in run.events("straggler")] == [1]


async def test_a_rank_whose_data_loading_is_80ms_slower_is_named_by_its_host_time(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """Rank 1 gets each batch 80 ms late: its forward time and (under DDP) its step time are
    the others'; only its host time between steps differs (issue 44, item 5)."""
    run = await serve(
        *("--nproc-per-node", "2", "--max-restarts", "0"),
        script=PLAIN_DDP,
        script_args=(*STRAGGLING, *SLOW_DATA_1, "--ckpt-dir", str(tmp_path / "c")),
    )
    async with api_of(run) as api:
        await run.stderr.expect(r"straggler: rank 1's time between steps outside", timeout=120)
        [event] = run.events("straggler")
        data = event["data"]
        assert data["global_rank"] == 1 and data["signal"] == "host", data
        assert data["ratio"] >= 1.2 and data["host_s"] - data["median_s"] >= 0.06, data
        code, status, _ = await api.call("GET", "/v1/status")
        assert code == 200
        progress = {r["global_rank"]: r["progress"] for r in status["ranks"]}
        assert progress[1]["host_s"] >= 0.08 > progress[0]["host_s"], progress
        # its forward pass is no slower: no forward straggler
        assert progress[1]["straggler"]["signal"] == "host", progress
        await marked_everywhere(api, "host")
    await stop(run)
    assert [e["data"]["signal"] for e in run.events("straggler")] == ["host"]


async def marked_everywhere(api: Api, signal: str) -> None:
    """Local rank 1, a straggler: marked in `ftd status`, `ftd top`, /metrics and the page's
    ranks table, by how much, in what and since when (issue 44, item 5)."""
    what = SIGNAL_WORDS[signal]
    for command in (("status",), ("top", "--once")):
        done = cli(*command, "--url", api.url)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        header = next(i for i, line in enumerate(lines) if line.startswith("LOCAL"))
        column = lines[header].index("STRAGGLER")
        rows = {line.split()[0]: line[column:].strip() for line in lines[header + 1 : header + 3]}
        assert re.fullmatch(rf"\d+\.\dx {what} since \d\d:\d\d:\d\d", rows["1"]), rows
        assert rows["0"] == NO_VALUE, rows
    code, metrics, _ = await api.call("GET", "/metrics")
    assert code == 200
    assert 'ftd_rank_straggler{local_rank="1"} 1.0' in metrics.splitlines(), metrics
    assert 'ftd_rank_straggler{local_rank="0"} 0.0' in metrics.splitlines(), metrics
    if async_playwright is None or shutil.which(CHROMIUM) is None:
        return
    async with browser() as chromium:
        page, errors = await open_page(chromium, api.url)
        cell = page.locator('#ranks tr[data-rank="1"] td.straggler.slow')
        await cell.filter(has_text=re.compile(rf"^\d+\.\dx {what} since ")).wait_for()
        assert await page.locator('#ranks tr[data-rank="0"] td.straggler').inner_text() == NO_VALUE
        assert errors == []
