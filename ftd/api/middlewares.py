"""The API's middlewares, outermost first: the connection (request start/end, for its
timers), metrics, errors (every error leaves as `application/problem+json`), the Host check,
and auth. Also the app's typed keys and `problem()`."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from ftd.api.connections import ApiLimits, Connections, Peer, tcp_peer
from ftd.api.control import NodeControl
from ftd.api.metrics import ApiMetrics
from ftd.api.security import HostPolicy, bearer_token
from ftd.api.sse import StreamHub
from ftd.errors import FtdError, Misdirected

log = logging.getLogger("ftd.api")

PROBLEM_TYPE = "application/problem+json"
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
OPEN_ROUTES = frozenset({"/healthz", "/readyz", "/", "/dashboard/{name}"})
"""Reads answered without a token on any address: the probes (alive/ready, nothing more) and
the dashboard's own files (no job data in them; the page's reads follow the rules below)."""
LOOPBACK_READS = frozenset({"/v1/status", "/v1/cluster", "/v1/events", "/v1/timeouts", "/metrics"})
"""Reads that an API listening on loopback only answers without a token: the daemon's own
account of the job (its status, with a failure's exception type and message; its events,
metrics and timeouts). Every other route needs the token over TCP, on loopback too, or the
admin socket: every change, and every read of what the job itself wrote, such as a rank's
stderr and stacks (`/v1/ranks/{global_rank}/stderr`, `/stacks`), where a secret the job
printed may be, which the 0700 run directory keeps from other local users. A route is
privileged unless it is named here: a new one cannot be public by omission."""
MAX_BODY_BYTES = 64 * 1024

CONTROL: web.AppKey[NodeControl] = web.AppKey("control")
TOKEN: web.AppKey[bytes] = web.AppKey("token")
HOSTS: web.AppKey[HostPolicy] = web.AppKey("hosts")
LIMITS: web.AppKey[ApiLimits] = web.AppKey("limits")
CONNECTIONS: web.AppKey[Connections] = web.AppKey("connections")
STREAMS: web.AppKey[StreamHub] = web.AppKey("streams")
METRICS: web.AppKey[ApiMetrics] = web.AppKey("metrics")
STARTED: web.AppKey[float] = web.AppKey("started")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def problem(
    status: int,
    title: str,
    detail: str,
    type_: str = "about:blank",
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> web.Response:
    body = {"type": type_, "title": title, "status": status, "detail": detail, **extra}
    return web.Response(
        status=status,
        text=json.dumps(body),
        content_type=PROBLEM_TYPE,
        headers=headers,
    )


def peer_of(request: web.Request) -> Peer:
    connection = request.app[CONNECTIONS].find(request.transport)
    if connection is not None:
        return connection.peer
    transport = request.transport
    return tcp_peer(transport) if transport is not None else Peer(False, "unknown")


def _http_problem(error: web.HTTPException) -> web.Response:
    headers = {k: v for k, v in error.headers.items() if k in ("Allow", "WWW-Authenticate")}
    detail = {
        404: "no such endpoint: see openapi.yaml for the routes",
        405: f"method not allowed; allowed: {error.headers.get('Allow', '')}",
        413: f"request body too large (the limit is {MAX_BODY_BYTES} bytes)",
    }.get(error.status, error.text or error.reason)
    return problem(error.status, error.reason, detail, headers=headers)


@web.middleware
async def connection_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    connection = request.app[CONNECTIONS].find(request.transport)
    if connection is None:
        return await handler(request)
    connection.request_started()
    try:
        return await handler(request)
    finally:
        connection.request_finished()


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    start = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    finally:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        request.app[METRICS].observe(request.method, route, status, time.perf_counter() - start)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except FtdError as error:
        response = web.Response(
            status=error.status,
            text=json.dumps(error.to_problem()),
            content_type=PROBLEM_TYPE,
            headers=error.headers(),
        )
        if error.status == 408:
            response.force_close()  # the rest of the body may still come: do not parse it
        return response
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return _http_problem(error)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unexpected error answering %s %s", request.method, request.path)
        return problem(500, "Internal error", "unexpected error; the daemon's log has the details")


@web.middleware
async def host_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    hosts = request.app[HOSTS]
    if not peer_of(request).trusted:
        sent = request.headers.getall("Host", [])
        if not hosts.allows(sent):
            allowed = ", ".join(sorted(hosts.names or ())) + " or a loopback address"
            raise Misdirected(
                f"this API listens on loopback and answers requests addressed to {allowed}, "
                f"not to {sent[0][:100]!r}"
            )
    return await handler(request)


def token_required(method: str, route: str, loopback_only: bool) -> bool:
    """Whether a TCP request for `route` (the route's template, as routed) must carry the
    bearer token: the one rule of who may call what (the admin socket's callers never do)."""
    if method not in READ_METHODS:
        return True
    if route in OPEN_ROUTES:
        return False
    return not (loopback_only and route in LOOPBACK_READS)


PRIVILEGED_READ = (
    "what the job itself wrote (a rank's stderr, its stacks) is read with the API token, on "
    "loopback too: "
)


def _unauthorized(detail: str, privileged_read: bool) -> web.Response:
    return problem(
        401,
        "Unauthorized",
        (PRIVILEGED_READ if privileged_read else "") + detail,
        "https://ftd.dev/problems/unauthorized",
        headers={"WWW-Authenticate": 'Bearer realm="ftd"'},
    )


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    unmatched = request.match_info.http_exception
    if unmatched is not None:
        raise unmatched  # 404 / 405 before auth: they reveal nothing
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else request.path
    loopback_only = request.app[HOSTS].loopback_only
    if token_required(request.method, route, loopback_only) and not peer_of(request).trusted:
        privileged_read = request.method in READ_METHODS and loopback_only
        sent = request.headers.getall("Authorization", [])
        if not sent:
            return _unauthorized(
                "send the API token as `Authorization: Bearer <token>` (the daemon's "
                "--api-token-file, default <run dir>/api.token, or FTD_API_TOKEN), or ask "
                "through the admin socket <run dir>/api.sock as the daemon's own user "
                "(`ftd ... --run-dir <run dir>`, `AdminClient.from_run_dir`)",
                privileged_read,
            )
        token = bearer_token(sent[0]) if len(sent) == 1 else None
        if token is None:
            return _unauthorized(
                "the Authorization header must be one `Bearer <token>`, the token in visible "
                "ASCII characters",
                privileged_read,
            )
        if not hmac.compare_digest(token.encode("ascii"), request.app[TOKEN]):
            return problem(
                403,
                "Forbidden",
                "the bearer token does not match this daemon's API token",
                "https://ftd.dev/problems/forbidden",
            )
    return await handler(request)


MIDDLEWARES = [
    connection_middleware,
    metrics_middleware,
    error_middleware,
    host_middleware,
    auth_middleware,
]
