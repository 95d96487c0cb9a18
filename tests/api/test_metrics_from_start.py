"""Issue 44 item 9: a fresh daemon's /metrics (its first attempt running, nothing failed yet)
has every family docs/api.md lists (a family the docs say is absent until something happens
excepted), `ftd_time_lost_seconds` and `ftd_last_failure_timestamp_seconds` among them, and
every query of the Grafana dashboard names only series such a daemon exports."""

from __future__ import annotations

import json
import re
import signal

import aiohttp

from tests.api.test_monitoring import dashboard_exprs, exported_series, metric_names
from tests.conftest import ROOT, Serve, ServeFactory, await_api_event

API_DOC = ROOT / "docs" / "api.md"
_ROW = re.compile(r"^\| ((?:`ftd_[a-z0-9_]+(?:\{[a-z_,]*\})?`(?:, )?)+) \| (.*) \|$")
_FAMILY = re.compile(r"`(ftd_[a-z0-9_]+)")


def documented_families() -> dict[str, str]:
    """Each metric family of docs/api.md's metrics table, with what the table says of it."""
    families: dict[str, str] = {}
    for line in API_DOC.read_text().splitlines():
        row = _ROW.match(line)
        if row:
            for name in _FAMILY.findall(row.group(1)):
                families[name.removesuffix("_total")] = row.group(2)
    return families


def test_the_docs_table_is_read() -> None:
    families = documented_families()
    assert len(families) >= 40, sorted(families)
    assert {"ftd_time_lost_seconds", "ftd_last_failure_timestamp_seconds", "ftd_restarts"} <= set(
        families
    )


async def _fresh_scrape(serve: ServeFactory) -> tuple[str, Serve]:
    run = await serve(
        "--preload",
        "none",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        script_args=("--hang",),
    )
    await run.stderr.expect(r"API listening on (\S+)")
    url = json.loads((run.run_dir / "api.json").read_text())["url"]
    # running its first attempt, nothing failed yet (the round's size exists from its start)
    await await_api_event(url, "state_changed", state="running")
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        assert response.status == 200
        exposition = await response.text()
    return exposition, run


async def test_a_fresh_daemon_exports_every_documented_family(serve: ServeFactory) -> None:
    exposition, run = await _fresh_scrape(serve)
    exported, families = exported_series(exposition)
    present = {name.removesuffix("_total") for name in families | exported}
    missing = {
        name: text
        for name, text in documented_families().items()
        if name not in present and "absent" not in text
    }
    assert not missing, f"documented but not exported by a fresh daemon: {sorted(missing)}"
    lines = exposition.splitlines()
    assert "ftd_last_failure_timestamp_seconds 0.0" in lines
    assert any(line.startswith("ftd_time_lost_seconds ") for line in lines)
    # the dashboard's every query names only series such a daemon exports
    queried = {
        name: where for where, expr in dashboard_exprs().items() for name in metric_names(expr)
    }
    unknown = {name: where for name, where in queried.items() if name not in exported}
    assert not unknown, f"the dashboard queries series a live daemon lacks: {unknown}"
    assert len(queried) >= 20
    run.signal(signal.SIGTERM)
    await run.wait()
