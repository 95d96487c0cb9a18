"""A node waiting in a round for others says so outside its log (issue 44, item 3): its
/v1/status (held to openapi.yaml) and `ftd status` name the round, the endpoint, who joined,
who of the round before is missing and the time left; the field clears when the round closes
(both backends, live daemons)."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from tests.conftest import Backend, Serve, ServeFactory
from tests.support.api import CONTRACT, cli
from tests.support.cluster import Cluster, api, run_dir
from tests.support.truth_page import browser, in_chromium, open_page, shot

JOIN_TIMEOUT_S = 600.0  # --rdzv-join-timeout's default


async def status_of(run: Serve, node: str) -> dict[str, Any]:
    code, status = await api(run, node, "GET", "/v1/status")
    assert code == 200, status
    CONTRACT.conforms("Status", status)
    return status


def url_of(run: Serve, node: str) -> str:
    url: str = json.loads((run_dir(run, node) / "api.json").read_text())["url"]
    return url


def ftd_status(run: Serve, node: str, command: str = "status") -> list[str]:
    done = cli(command, *(("--once",) if command == "top" else ()), "--url", url_of(run, node))
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def left_s(line: str) -> float:
    return float(line.rsplit("gives up in ", 1)[1].removesuffix(" s"))


async def test_a_waiting_node_says_who_joined_who_is_missing_and_the_time_left(
    serve: ServeFactory, backend: Backend, tmp_path: Path
) -> None:
    cluster = Cluster(serve, "2", backend=backend)
    a = await cluster.first("a", "--hang")
    # The log says it every 5 s; the status had it from the first read.
    await a.stderr.expect(r"round 0: waiting for nodes: 1 joined \(a\), 2 to 2 wanted")
    status = await status_of(a, "a")
    assert status["state"] == "rendezvous" and status["standby"] is None, status
    wait = status["waiting"]
    assert {k: v for k, v in wait.items() if k != "left_s"} == {
        "round": 0,
        "endpoint": cluster.endpoint,
        "joined": ["a"],
        "joined_count": 1,
        "missing": [],
        "nnodes_min": 2,
        "nnodes_max": 2,
    }, wait
    assert JOIN_TIMEOUT_S - 120 < wait["left_s"] < JOIN_TIMEOUT_S, wait
    [line] = [line for line in ftd_status(a, "a") if line.startswith("waiting for nodes")]
    assert line.startswith(
        f"waiting for nodes in round 0 at {cluster.endpoint}: 1 of 2 joined (a); missing: none; "
        "gives up in "
    ), line
    assert JOIN_TIMEOUT_S - 120 < left_s(line) <= wait["left_s"] + 0.5, line  # rounded
    assert any(row.startswith(line.rsplit(" in ", 1)[0]) for row in ftd_status(a, "a", "top"))

    b = await cluster.node("b", "--hang")
    await a.stdout.expect("ready a0 r0")
    await b.stdout.expect("ready a0 r1")
    assert (await status_of(a, "a"))["waiting"] is None
    assert not any(line.startswith("waiting") for line in ftd_status(a, "a"))

    # b is lost: a waits in the next round for it, and says it is missing.
    b.signal(signal.SIGKILL)
    await a.stderr.expect(r"round 1: waiting for nodes: 1 joined \(a\), .*not back yet: b")
    wait = (await status_of(a, "a"))["waiting"]
    assert (wait["round"], wait["joined"], wait["missing"]) == (1, ["a"], ["b"]), wait
    [line] = [line for line in ftd_status(a, "a") if line.startswith("waiting for nodes")]
    assert "round 1" in line and "1 of 2 joined (a); missing: b; gives up in" in line, line

    again = await cluster.node("b", "--hang")
    await a.stdout.expect("ready a1 r0")
    assert (await status_of(a, "a"))["waiting"] is None
    for run in (a, again):
        run.signal(signal.SIGTERM)
    assert await a.wait() == 128 + signal.SIGTERM
    assert await again.wait() == 128 + signal.SIGTERM


@in_chromium
async def test_the_page_says_the_node_waits_until_the_round_closes(
    serve: ServeFactory, tmp_path: Path
) -> None:
    cluster = Cluster(serve, "2")
    a = await cluster.first("a", "--hang")
    await a.stderr.expect("API listening on")
    async with browser() as chromium:
        page, errors = await open_page(chromium, url_of(a, "a"))
        said = f"waiting for nodes in round 0 at {cluster.endpoint}: 1 of 2 joined (a); "
        await page.locator("#waiting", has_text=said + "missing: none; gives up in").wait_for()
        await shot(page, tmp_path, "waiting-for-nodes")
        b = await cluster.node("b", "--hang")
        await a.stdout.expect("ready a0 r0")
        await page.locator("#waiting").wait_for(state="hidden")
        assert errors == []
    for run in (a, b):
        run.signal(signal.SIGTERM)
    assert await a.wait() == 128 + signal.SIGTERM
    await b.wait()
