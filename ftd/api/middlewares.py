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
UNAUTHENTICATED = frozenset({"/healthz", "/readyz"})
"""Probes answer without a token on any address (they say nothing but alive/ready)."""
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
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


def _is_page(path: str) -> bool:
    """The dashboard's static files (the page, its script and style): no job data in them."""
    return path == "/" or path.startswith("/dashboard/")


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    unmatched = request.match_info.http_exception
    if unmatched is not None:
        raise unmatched  # 404 / 405 before auth: they reveal nothing
    reads_need_token = not request.app[HOSTS].loopback_only
    needs_token = request.method not in READ_METHODS or reads_need_token
    if request.method in READ_METHODS and _is_page(request.path):
        needs_token = False  # the dashboard's own files hold no data; its reads need the token
    if needs_token and request.path not in UNAUTHENTICATED and not peer_of(request).trusted:
        challenge = {"WWW-Authenticate": 'Bearer realm="ftd"'}
        sent = request.headers.getall("Authorization", [])
        if not sent:
            return problem(
                401,
                "Unauthorized",
                "send the API token as `Authorization: Bearer <token>` (the daemon's "
                "--api-token-file, or FTD_API_TOKEN)",
                "https://ftd.dev/problems/unauthorized",
                headers=challenge,
            )
        token = bearer_token(sent[0]) if len(sent) == 1 else None
        if token is None:
            return problem(
                401,
                "Unauthorized",
                "the Authorization header must be one `Bearer <token>`, the token in visible "
                "ASCII characters",
                "https://ftd.dev/problems/unauthorized",
                headers=challenge,
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
