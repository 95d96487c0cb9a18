"""The dashboard in headless Chromium for tests/test_dashboard_truth.py: the browser, pages,
screenshots (FTD_TEST_SHOTS, else `<pytest tmp dir>/screenshots/`) and a stub API (real
aiohttp on 127.0.0.1: the page's files, a canned status and cluster, an event stream)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from ftd.api.dashboard import add_dashboard_routes

CHROMIUM = os.environ.get("FTD_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
DASH = "\u2013"  # what the page shows for a number it does not have

try:
    from playwright.async_api import Browser, Page, async_playwright
except ImportError:  # pragma: no cover - the test extra installs it
    async_playwright = None

in_chromium = pytest.mark.skipif(
    async_playwright is None or shutil.which(CHROMIUM) is None,
    reason=f"needs playwright and Chromium at {CHROMIUM} (see README, Tests)",
)


@asynccontextmanager
async def browser() -> AsyncIterator[Browser]:
    assert async_playwright is not None
    async with async_playwright() as playwright:
        chromium = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            await chromium.close()


async def open_page(chromium: Browser, url: str) -> tuple[Page, list[str]]:
    page = await chromium.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(f"uncaught: {error}"))
    await page.goto(url + "/")
    return page, errors


async def shot(page: Page, tmp_path: Path, name: str) -> None:
    where = Path(os.environ.get("FTD_TEST_SHOTS") or tmp_path / "screenshots")
    where.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=str(where / f"{name}.png"), full_page=True)
    print(f"screenshot: {where / name}.png")


# -- a stub API ------------------------------------------------------------------------------


def stub_status(**changes: Any) -> dict[str, Any]:
    rank = {"pid": 1000, "state": "running", "exit_code": None, "started_at": time.time() - 60}
    rank |= {"ended_at": None, "section": "step", "section_age_s": 0.1}
    ranks = [
        {**rank, "local_rank": i, "global_rank": i, "last_heartbeat_age_s": age}
        for i, age in enumerate([0.5, 3.6, 6.0])
    ]
    doc = {
        "node_id": "node-a",
        "run_id": "stub",
        "state": "running",
        "attempt": 1,
        "round": 1,
        "restart_count": 1,
        "max_restarts": 3,
        "ranks": ranks,
        "last_failure": None,
        "backoff_s": 0.0,
        "pid": 1,
        "uptime_s": 60.0,
        "policy": {
            "restart_policy": "any-failed",
            "max_restarts": 3,
            "restarts_left": 2,
            "nnodes_min": 1,
            "nnodes_max": 1,
            "multi_node": False,
        },
        "timeouts": {
            "initial_rank_heartbeat_timeout": 60.0,
            "rank_heartbeat_timeout": 5.0,
            "rank_section_timeouts": {},
            "rank_out_of_section_timeout": None,
        },
    }
    doc.update(changes)
    return doc


class Stub:
    """The dashboard's files and canned answers; events appended reach the page's stream."""

    def __init__(self, status: dict[str, Any]) -> None:
        self.status = status
        self.events: list[dict[str, Any]] = []
        self.changed = asyncio.Event()

    def event(self, kind: str, at: float, **data: Any) -> None:
        self.events.append({"id": len(self.events) + 1, "time": at, "kind": kind, "data": data})
        self.changed.set()

    async def get_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status)

    async def get_cluster(self, request: web.Request) -> web.Response:
        summary = {"node_id": self.status["node_id"], "state": "running", "round": 1}
        members = {"round": 1, "members": [self.status["node_id"]]}
        return web.json_response({"nodes": [summary], "round": members, "excluded": []})

    async def get_events(self, request: web.Request) -> web.StreamResponse:
        since = int(request.query.get("since", "0"))
        if "text/event-stream" not in request.headers.get("Accept", ""):
            page = [e for e in self.events if e["id"] > since]
            return web.json_response({"events": page, "last_id": len(self.events)})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        cursor = since
        while True:
            for event in self.events[cursor:]:
                await response.write(f"id: {event['id']}\ndata: {json.dumps(event)}\n\n".encode())
                cursor = event["id"]
            self.changed.clear()
            await self.changed.wait()


@asynccontextmanager
async def stub_server(stub: Stub) -> AsyncIterator[str]:
    app = web.Application()
    add_dashboard_routes(app)
    app.router.add_get("/v1/status", stub.get_status)
    app.router.add_get("/v1/cluster", stub.get_cluster)
    app.router.add_get("/v1/events", stub.get_events)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        stub.changed.set()
        await runner.cleanup()
