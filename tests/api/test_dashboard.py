"""The dashboard in a real headless Chromium (Debian's `chromium`, driven by Playwright): against
a live `ftd serve`, and against a stub API (real aiohttp) for what a small job cannot show (512
nodes, the stages of a recovery). Screenshots go to runs/screenshots/ for a person to look at."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from ftd.api.dashboard import add_dashboard_routes
from tests.conftest import BIN, ROOT, ServeFactory, await_api_event

CHROMIUM = os.environ.get("FTD_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SHOTS = ROOT / "runs" / "screenshots"

try:
    from playwright.async_api import Browser, ConsoleMessage, Page, async_playwright
except ImportError:  # pragma: no cover - the test extra installs it
    async_playwright = None

pytestmark = [
    pytest.mark.skipif(async_playwright is None, reason="playwright is not installed"),
    pytest.mark.skipif(
        shutil.which(CHROMIUM) is None,
        reason=f"no Chromium at {CHROMIUM}: apt-get install -y chromium (see README, Tests)",
    ),
    pytest.mark.timeout(240),
]


@asynccontextmanager
async def browser() -> AsyncIterator[Browser]:
    assert async_playwright is not None
    async with async_playwright() as playwright:
        chromium = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            await chromium.close()


class Console:
    """The page's console errors and uncaught exceptions."""

    def __init__(self, page: Page) -> None:
        self.errors: list[str] = []
        page.on("console", self._message)
        page.on("pageerror", lambda error: self.errors.append(f"uncaught: {error}"))

    def _message(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.errors.append(message.text)

    def unexpected(self, allowed: tuple[int, ...] = ()) -> list[str]:
        codes = "|".join(str(code) for code in allowed) or "none"
        expected = re.compile(rf"Failed to load resource: .* status of ({codes})\b")
        return [error for error in self.errors if not expected.search(error)]


async def shot(page: Page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


async def new_page(chromium: Browser) -> tuple[Page, Console]:
    page = await chromium.new_page(viewport={"width": 1400, "height": 1000})
    return page, Console(page)


async def confirm(page: Page) -> None:
    await page.locator("#confirm[open]").wait_for()
    await page.click("#confirm-ok")


# -- a live daemon --------------------------------------------------------------------------


async def _events(url: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/events") as r:
        page: dict[str, Any] = await r.json()
    events: list[dict[str, Any]] = page["events"]
    return events


async def test_dashboard_shows_the_live_job_and_acts_only_with_the_token(
    serve: ServeFactory,
) -> None:
    run = await serve(
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "5",
        "--ft-param-rank_heartbeat_timeout=60",
        script=BIN / "dash_rank.py",
    )
    url = (await run.stderr.expect(r"API listening on (http://\S+)"))[1]
    for rank in (0, 1):
        await run.stdout.expect(f"dash rank {rank} attempt 0 up")
    token = (run.run_dir / "api.token").read_text().strip()
    async with browser() as chromium:
        page, console = await new_page(chromium)
        await page.goto(url + "/")
        # This node's ranks, live: pids as the daemon reports them, ages ticking.
        await page.wait_for_function(
            "() => document.querySelectorAll('#ranks tbody td.state.s-running').length === 2"
        )
        async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/status") as r:
            status = await r.json()
        pids = sorted(str(rank["pid"]) for rank in status["ranks"])
        shown = await page.locator("#ranks tbody tr td:nth-child(3)").all_inner_texts()
        assert sorted(shown) == pids
        await page.wait_for_function(
            "() => [...document.querySelectorAll('#ranks td.age')]"
            ".some(c => c.textContent.endsWith(' s'))"
        )
        first = await page.locator("#ranks tbody tr td.age").first.inner_text()
        await page.wait_for_function(
            "first => document.querySelector('#ranks tbody tr td.age').textContent !== first",
            arg=first,
        )
        await page.locator(".tile.self.s-running").wait_for()
        await page.locator("#stream-state", has_text="live").wait_for()
        await page.locator('.attempt[data-attempt="0"]').wait_for()
        assert "rank_heartbeat_timeout" not in await page.locator("#timeouts").inner_text()
        assert "heartbeat 60" in await page.locator("#timeouts").inner_text()
        assert await page.locator("#banner").is_hidden()
        await shot(page, "dashboard-live")
        assert console.unexpected() == []

        # An action without the token is refused in the page, and nothing is sent.
        await page.fill("#restart-reason", "from the dashboard test")
        await page.click("#restart-form button[type=submit]")
        result = page.locator("#action-result")
        await result.filter(has_text="refused").wait_for()
        assert "needs the API token" in await result.inner_text()
        assert not await page.locator("#confirm[open]").count()
        await shot(page, "dashboard-refused-without-token")

        # A wrong token: the daemon's problem is shown.
        await page.fill("#token", "not-the-token")
        await page.click("#token-save")
        await page.click("#restart-form button[type=submit]")
        await confirm(page)
        await result.filter(has_text="403").wait_for()
        assert "Forbidden" in await result.inner_text()
        assert "restart_requested" not in {e["kind"] for e in await _events(url)}

        # Cancelling asks nothing of the daemon.
        await page.click("#token-forget")
        await page.fill("#token", token)
        await page.click("#token-save")
        await page.click("#restart-form button[type=submit]")
        await page.locator("#confirm[open]").wait_for()
        await page.click("#confirm-cancel")
        await result.filter(has_text="cancelled").wait_for()

        # With the token, confirmed: performed, and the new attempt appears on the timeline.
        await page.click("#restart-form button[type=submit]")
        await confirm(page)
        await result.filter(has_text="done").wait_for()
        kinds = [e["kind"] for e in await _events(url)]
        assert "restart_requested" in kinds
        await page.locator('.attempt[data-attempt="1"]').wait_for(timeout=60_000)
        await page.locator(
            "#events li.k-restart_requested", has_text="from the dashboard test"
        ).wait_for()
        for rank in (0, 1):
            await run.stdout.expect(f"dash rank {rank} attempt 1 up")
        await await_api_event(url, "attempt_started", attempt=1)  # the status has the new pids
        await page.wait_for_function(
            "() => document.querySelectorAll('#ranks tbody td.state.s-running').length === 2"
        )
        async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/status") as r:
            pids = sorted(str(rank["pid"]) for rank in (await r.json())["ranks"])
        await page.wait_for_function(
            "pids => [...document.querySelectorAll('#ranks tbody tr td:nth-child(3)')]"
            ".map(c => c.textContent).sort().join() === pids.join()",
            arg=pids,
        )
        await page.locator('.attempt[data-attempt="0"].s-restarting').wait_for()
        await shot(page, "dashboard-after-restart")

        # Timeouts, through the page.
        await page.fill("#t-rank_heartbeat_timeout", "45")
        await page.click("#timeouts-form button[type=submit]")
        await confirm(page)
        await result.filter(has_text="timeouts: done").wait_for()
        await page.locator("#timeouts", has_text="heartbeat 45").wait_for()
        await page.locator("#events li.k-timeouts_changed").wait_for()

        # Exclusion needs several nodes: a single node's page offers no form that always fails.
        assert await page.locator("#exclude-form").is_hidden()
        assert "single node" in await page.locator("#exclude-note").inner_text()
        await shot(page, "dashboard-actions")
        assert console.unexpected(allowed=(403,)) == []

        # Filters: by kind.
        await page.select_option("#filter-kind", "timeouts_changed")
        await page.wait_for_function(
            "() => [...document.querySelectorAll('#events li')].every("
            "li => li.classList.contains('k-timeouts_changed'))"
        )
        await page.close()
    run.signal(signal.SIGTERM)
    await run.wait()


async def test_the_recovery_stages_of_a_live_restart(serve: ServeFactory) -> None:
    """Once the daemon emits `recovery` events, each restart shows its stages."""
    run = await serve("--standalone", "--nproc-per-node", "1", script=BIN / "dash_rank.py")
    url = (await run.stderr.expect(r"API listening on (http://\S+)"))[1]
    await run.stdout.expect("dash rank 0 attempt 0 up")
    # A forked rank can print before the daemon is running (a restart then is a 409).
    await await_api_event(url, "state_changed", state="running")
    token = (run.run_dir / "api.token").read_text().strip()
    async with aiohttp.ClientSession() as session:
        headers = {"Authorization": f"Bearer {token}"}
        async with session.post(f"{url}/v1/restart", json={"count": False}, headers=headers) as r:
            assert r.status == 202
    await run.stdout.expect("dash rank 0 attempt 1 up")
    await _await_event(url, "recovery", timeout=60)
    async with browser() as chromium:
        page, console = await new_page(chromium)
        await page.goto(url + "/")
        row = page.locator('.recovery[data-attempt="1"]')
        await row.wait_for()
        for stage in ("detect", "stop", "rendezvous", "spawn", "init"):
            await row.locator(f".stage-{stage}").wait_for()
        await shot(page, "dashboard-live-recovery")
        assert console.unexpected() == []
    run.signal(signal.SIGTERM)
    await run.wait()


async def _await_event(url: str, kind: str, timeout: float) -> dict[str, Any]:
    headers = {"Accept": "text/event-stream"}
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{url}/v1/events?since=0", headers=headers) as response,
    ):

        async def find() -> dict[str, Any]:
            async for raw in response.content:
                line = raw.decode().strip()
                if line.startswith("data:"):
                    event: dict[str, Any] = json.loads(line[5:])
                    if event["kind"] == kind:
                        return event
            raise AssertionError(f"the event stream ended without a {kind} event")

        return await asyncio.wait_for(find(), timeout)


# -- a stub API: 512 nodes and recoveries ----------------------------------------------------

HOSTILE = '<img src=x onerror="document.title=1">\u202e'
STATES = ["running", "running", "running", "rendezvous", "restarting", "failed", "succeeded"]
STANDBYS = (508, 509)
"""Nodes of the stub's cluster that wait as standbys (hot spares): not members of the round."""


class StubApi:
    """Real aiohttp on 127.0.0.1 serving the dashboard and canned API answers; events pushed
    into `push` reach the page's stream."""

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes
        self.cluster_calls = 0
        self.events: list[dict[str, Any]] = []
        self.changed = asyncio.Event()
        self.start = time.time() - 600

    def event(self, kind: str, at: float, **data: Any) -> dict[str, Any]:
        event = {"id": len(self.events) + 1, "time": at, "kind": kind, "data": data}
        self.events.append(event)
        self.changed.set()
        return event

    async def status(self, request: web.Request) -> web.Response:
        ranks = [
            {
                "local_rank": i,
                "global_rank": i,
                "pid": 1000 + i,
                "state": "running",
                "exit_code": None,
                "started_at": self.start,
                "ended_at": None,
                "last_heartbeat_age_s": 0.5,
                "section": "step",
                "section_age_s": 0.2,
            }
            for i in range(8)
        ]
        return web.json_response(
            {
                "node_id": "node-0000",
                "run_id": "stub",
                "state": "running",
                "attempt": 2,
                "round": 2,
                "restart_count": 2,
                "max_restarts": 10,
                "ranks": ranks,
                "last_failure": None,
                "pid": 1,
                "uptime_s": 600.0,
                "policy": {
                    "restart_policy": "any-failed",
                    "max_restarts": 10,
                    "restarts_left": 8,
                    "nnodes_min": 400,
                    "nnodes_max": self.nodes,
                },
                "timeouts": {
                    "initial_rank_heartbeat_timeout": 600.0,
                    "rank_heartbeat_timeout": 60.0,
                    "rank_section_timeouts": {"step": 180.0},
                    "rank_out_of_section_timeout": None,
                },
            }
        )

    async def cluster(self, request: web.Request) -> web.Response:
        self.cluster_calls += 1
        shift = self.cluster_calls
        nodes = [
            {
                "node_id": f"node-{i:04d}",
                "state": STATES[(i * 3 + (shift if i % 10 == 0 else 0)) % len(STATES)],
                "attempt": 2,
                "group_rank": i,
                "nproc_per_node": 8,
                "restart_count": 2,
                "last_failure": "rank 3 exited with exit code 1" if i % 50 == 7 else None,
                "role": "standby" if i in STANDBYS else "active",
            }
            for i in range(self.nodes)
        ]
        nodes[511]["node_id"] = HOSTILE  # a hostile store value: shown, never parsed as HTML
        nodes[510]["state"] = "<b>weird</b>"
        excluded = [{"node_id": f"node-{i:04d}", "reason": "bad NIC"} for i in (13, 99)]
        members = [n["node_id"] for n in nodes if n["role"] == "active"]
        return web.json_response(
            {"nodes": nodes, "round": {"round": 2, "members": members}, "excluded": excluded}
        )

    async def events_route(self, request: web.Request) -> web.StreamResponse:
        since = int(request.query.get("since", "0"))
        if "text/event-stream" not in request.headers.get("Accept", ""):
            limit = int(request.query.get("limit", "1000"))
            page = [e for e in self.events if e["id"] > since][:limit]
            return web.json_response({"events": page, "last_id": len(self.events)})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        cursor = since
        while True:
            for event in self.events[cursor:]:
                body = f"id: {event['id']}\nevent: {event['kind']}\ndata: {json.dumps(event)}\n\n"
                await response.write(body.encode())
                cursor = event["id"]
            self.changed.clear()
            await self.changed.wait()

    def app(self) -> web.Application:
        app = web.Application()
        add_dashboard_routes(app)
        app.router.add_get("/v1/status", self.status)
        app.router.add_get("/v1/cluster", self.cluster)
        app.router.add_get("/v1/events", self.events_route)
        return app


@asynccontextmanager
async def stub_server(stub: StubApi) -> AsyncIterator[str]:
    runner = web.AppRunner(stub.app(), shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stub.changed.set()
        await runner.cleanup()


async def test_a_512_node_job_and_recovery_stages() -> None:
    stub = StubApi(512)
    t = stub.start
    stub.event("attempt_started", t, attempt=0, pids=[1])
    stub.event("attempt_failed", t + 200, attempt=0, failure={"reason": "rank 3 exited 1"})
    stub.event("attempt_started", t + 201.2, attempt=1, pids=[2])
    stub.event(
        "recovery",
        t + 203,
        attempt=1,
        round=1,
        cause="rank 3 exited with exit code 1",
        stages={
            "detect": 0.004,
            "stop": 0.2,
            "rendezvous": 0.9,
            "spawn": 0.1,
            "init": 1.5,
            "restore": 0.3,
            "redo": 0.5,
        },
        total_s=3.504,
        failure_time=t + 200,
    )
    stub.event("node_excluded", t + 300, node_id="node-0013", reason="bad NIC", by="api")
    stub.event("<script>x</script>", t + 301, note="<img src=y onerror=alert(2)>")
    async with stub_server(stub) as url, browser() as chromium:
        page, console = await new_page(chromium)
        await page.goto(url + "/")
        await page.wait_for_function(
            "() => document.querySelectorAll('#tiles .tile').length === 512"
        )
        await page.wait_for_function(
            "() => window.__ftd.clusterRenderMs.length >= 3", timeout=30_000
        )
        times = await page.evaluate("window.__ftd.clusterRenderMs")
        first, updates = times[0], times[1:]
        print(f"512-node cluster: first render {first:.1f} ms, updates {updates} ms")
        assert first < 1000, times
        assert max(updates) < 250, times
        assert await page.locator(".tile.excluded").count() == 2
        assert await page.locator(".tile.self").count() == 1
        summary = await page.locator("#cluster-summary").inner_text()
        assert "512 nodes" in summary and "2 standby" in summary, summary
        spares = page.locator(".tile.standby")  # hot spares: a "standby" badge on their tiles
        assert await spares.count() == len(STANDBYS)
        assert await spares.locator(".badge.standby").all_inner_texts() == ["STANDBY"] * 2
        assert await page.locator('.tile[data-node="node-0508"] .badge.standby').count() == 1
        assert await page.locator("#banner").is_hidden()
        assert await page.locator("img").count() == 0 and await page.title() == "ftd"
        assert await page.locator(".tile", has_text='<img src=x onerror="').count() == 1
        assert await page.locator(".tile", has_text="<b>weird</b>").count() == 1
        # The recovery's stages, each with its duration, in order.
        row = page.locator('.recovery[data-attempt="1"]')
        stages = await row.locator(".stage").all_inner_texts()
        assert [s.split()[0] for s in stages] == [
            "detect",
            "stop",
            "rendezvous",
            "spawn",
            "init",
            "restore",
            "redo",
        ]
        assert stages[0] == "detect 4 ms" and stages[-1] == "redo 500 ms"
        assert "3.50 s" in await row.locator(".total").inner_text()
        await page.locator('.attempt[data-attempt="0"].s-failed').wait_for()
        # A recovery arriving on the stream is drawn as it happens.
        now = time.time()
        stub.event("attempt_started", now - 1, attempt=2, pids=[3])
        stub.event(
            "recovery",
            now,
            attempt=2,
            round=2,
            cause="hang: rank 5 no heartbeat for 60.0s",
            stages={"detect": 60.0, "stop": 1.1, "rendezvous": 0.3, "spawn": 0.2, "init": 2},
            total_s=63.6,
            failure_time=now - 64,
        )
        await page.locator('.recovery[data-attempt="2"] .stage-detect').wait_for()
        await page.locator('.attempt[data-attempt="2"]').wait_for()
        # Filters: by node, then by kind.
        await page.select_option("#filter-node", "node-0013")
        await page.wait_for_function("() => document.querySelectorAll('#events li').length === 1")
        await page.select_option("#filter-node", "")
        await page.select_option("#filter-kind", "recovery")
        await page.wait_for_function("() => document.querySelectorAll('#events li').length === 2")
        await page.select_option("#filter-kind", "")
        width = await page.evaluate("document.documentElement.scrollWidth")
        assert width <= 1400, f"the page is wider than the window: {width}px"
        await shot(page, "dashboard-512-nodes")
        assert console.unexpected() == []


async def test_the_page_and_its_files_are_served_with_a_strict_policy() -> None:
    async with stub_server(StubApi(1)) as url, aiohttp.ClientSession() as session:
        for path, kind in [("/", "text/html"), ("/dashboard/app.js", "text/javascript")]:
            async with session.get(url + path) as r:
                assert r.status == 200 and r.content_type == kind
                assert "script-src 'self'" in r.headers["Content-Security-Policy"]
                assert r.headers["X-Content-Type-Options"] == "nosniff"
        for path in [
            "/dashboard/../api.token",
            "/dashboard/index.html.bak",
            "/dashboard/api.token",
        ]:
            async with session.get(url + path) as r:
                assert r.status == 404, path
    html = (ROOT / "ftd/api/dashboard/static/index.html").read_text()
    assert "http" not in html  # nothing fetched from elsewhere
