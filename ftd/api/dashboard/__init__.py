"""The dashboard: one page at `/` of the REST API, served from package data (no build step,
nothing fetched from elsewhere). It reads what any API client reads (`/v1/status`,
`/v1/cluster`, `/v1/events` and its stream) under the same auth rules, and acts through the
same endpoints with the bearer token the operator types into the page (kept in the tab's
sessionStorage only). A rank's stderr and stacks need that token on loopback too: a 401 asks
for it beside the text and reads again with it, in the Authorization header only.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

SCRIPTS = ("core.js", "progress.js", "node.js", "cluster.js", "events.js", "app.js")
"""The page's scripts, in their order of loading (one global scope, core.js first)."""
ASSETS = {
    **dict.fromkeys(SCRIPTS, "text/javascript"),
    "style.css": "text/css",
}
PAGE = "index.html"
SECURITY_HEADERS = {
    # Only this origin's own files and API; no inline script, no framing by other pages.
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
DASHBOARD_FILES: web.AppKey[dict[str, bytes]] = web.AppKey("dashboard_files")


def _read(name: str) -> bytes:
    return (resources.files(__package__) / "static" / name).read_bytes()


async def index(request: web.Request) -> web.Response:
    return web.Response(
        body=request.app[DASHBOARD_FILES][PAGE],
        content_type="text/html",
        charset="utf-8",
        headers=SECURITY_HEADERS,
    )


async def asset(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in ASSETS:
        raise web.HTTPNotFound()
    return web.Response(
        body=request.app[DASHBOARD_FILES][name],
        content_type=ASSETS[name],
        charset="utf-8",
        headers=SECURITY_HEADERS,
    )


def add_dashboard_routes(app: web.Application) -> None:
    """`GET /` (the page) and `GET /dashboard/{name}` (its script and style), read once."""
    app[DASHBOARD_FILES] = {name: _read(name) for name in (PAGE, *ASSETS)}
    app.router.add_get("/", index, allow_head=False)
    app.router.add_get("/dashboard/{name}", asset, allow_head=False)
