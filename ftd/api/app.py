"""The aiohttp application: routes, the error/metrics/auth middlewares, request models.

Every error leaves as `application/problem+json` (type, title, status, detail); a domain
error (`ftd.errors.FtdError`) maps 1:1 to its status, an unexpected one to a 500 problem
without a traceback (the traceback goes to the daemon's log).
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal, TypeVar

from aiohttp import web
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from ftd.api.sse import stream_events
from ftd.control import DaemonControl
from ftd.dashboard import add_dashboard_routes
from ftd.errors import FeatureUnavailable, FtdError, InvalidRequest
from ftd.metrics import ApiMetrics, build_registry, exposition
from ftd.state import DaemonState, RankState

log = logging.getLogger("ftd.api")

MAX_BODY_BYTES = 64 * 1024
MAX_EVENTS_PER_PAGE = 10_000
PROBLEM_TYPE = "application/problem+json"
UNAUTHENTICATED = frozenset({"/healthz", "/readyz"})
"""Probes answer without a token on any address (they say nothing but alive/ready)."""
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

CONTROL: web.AppKey[DaemonControl] = web.AppKey("control")
TOKEN: web.AppKey[bytes] = web.AppKey("token")
READS_NEED_TOKEN: web.AppKey[bool] = web.AppKey("reads_need_token")
CLOSING: web.AppKey[asyncio.Event] = web.AppKey("closing")
METRICS: web.AppKey[ApiMetrics] = web.AppKey("metrics")
STARTED: web.AppKey[float] = web.AppKey("started")

M = TypeVar("M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# -- request models (mirrored by openapi.yaml; a test fails when they drift) -------------------


class RestartRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    scope: Literal["cluster", "node"] = "cluster"
    reason: str = Field("operator request", max_length=1000)
    count: bool = True
    """Whether the restart counts against --max-restarts."""


def _integral_float_to_int(value: object) -> object:
    # JSON Schema's integer includes 3.0; strict pydantic would refuse it.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


JsonInt = Annotated[int, BeforeValidator(_integral_float_to_int)]


class FaultRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    kind: Literal["kill", "hang"]
    rank: JsonInt | Literal["random"] = Field("random")
    """Global rank on this node, or "random"."""
    delay_s: float = Field(0.0, ge=0, le=3600)


class ExcludeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    reason: str = Field("operator request", max_length=1000)


# -- problems and middlewares -----------------------------------------------------------------


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


def _http_problem(error: web.HTTPException) -> web.Response:
    headers = {k: v for k, v in error.headers.items() if k in ("Allow", "WWW-Authenticate")}
    detail = {
        404: "no such endpoint: see openapi.yaml for the routes",
        405: f"method not allowed; allowed: {error.headers.get('Allow', '')}",
        413: f"request body too large (the limit is {MAX_BODY_BYTES} bytes)",
    }.get(error.status, error.text or error.reason)
    return problem(error.status, error.reason, detail, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except FtdError as error:
        return web.Response(
            status=error.status, text=json.dumps(error.to_problem()), content_type=PROBLEM_TYPE
        )
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
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    unmatched = request.match_info.http_exception
    if unmatched is not None:
        raise unmatched  # 404 / 405 before auth: they reveal nothing
    needs_token = request.method not in READ_METHODS or request.app[READS_NEED_TOKEN]
    if needs_token and request.path not in UNAUTHENTICATED:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        challenge = {"WWW-Authenticate": 'Bearer realm="ftd"'}
        if scheme.lower() != "bearer" or not token.strip():
            return problem(
                401,
                "Unauthorized",
                "send the API token as `Authorization: Bearer <token>` (the daemon's "
                "--api-token-file, or FTD_API_TOKEN)",
                "https://ftd.dev/problems/unauthorized",
                headers=challenge,
            )
        if not hmac.compare_digest(token.strip().encode(), request.app[TOKEN]):
            return problem(
                403,
                "Forbidden",
                "the bearer token does not match this daemon's API token",
                "https://ftd.dev/problems/forbidden",
            )
    return await handler(request)


# -- helpers ----------------------------------------------------------------------------------


def _no_constants(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


async def _body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object ({} for an empty body); 400 naming the problem, 413 above
    the size limit (raised by aiohttp while reading)."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except (ValueError, UnicodeDecodeError) as error:
        raise InvalidRequest(f"body: not valid JSON ({error})") from None
    if not isinstance(body, dict):
        raise InvalidRequest("body: expected a JSON object")
    return body


def _validate(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as error:
        problems = []
        for item in error.errors():
            field = ".".join(str(part) for part in item["loc"]) or "body"
            problems.append(f"{field}: {str(item['msg']).removeprefix('Value error, ')}")
        raise InvalidRequest("; ".join(problems)) from None


def _is_seconds(value: object) -> bool:
    if value is None:
        return True
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_seconds(patch: dict[str, Any]) -> None:
    """JSON types of a timeouts patch: seconds (number) or null, or a map of those for the
    sections. The daemon's model checks names and ranges; this keeps the command line's
    string forms ("none", "setup:600") off the API, where openapi.yaml promises numbers."""
    for name, value in patch.items():
        if isinstance(value, dict):
            for section, seconds in value.items():
                if not _is_seconds(seconds):
                    raise InvalidRequest(f"{name}.{section}: expected seconds or null")
        elif not _is_seconds(value):
            raise InvalidRequest(f"{name}: expected seconds (a number) or null")


def _requested_by(request: web.Request) -> str:
    return f"api {request.remote or 'unknown'}"


def _int_query(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest(f"{name}: expected an integer, got {raw!r}") from None
    if not low <= value <= high:
        raise InvalidRequest(f"{name}: must be between {low} and {high}, got {value}")
    return value


def status_document(control: DaemonControl, started: float) -> dict[str, Any]:
    """`/v1/status`: the node's status, its restart policy and the timeouts in force."""
    doc: dict[str, Any] = control.status.to_dict()
    doc.setdefault("round", doc["attempt"])
    doc["pid"] = os.getpid()
    doc["uptime_s"] = round(time.monotonic() - started, 3)
    doc["policy"] = {
        "restart_policy": control.config.restart_policy,
        "max_restarts": control.config.max_restarts,
        "restarts_left": max(0, control.config.max_restarts - control.status.restart_count),
        "nnodes_min": control.config.nnodes_min,
        "nnodes_max": control.config.nnodes_max,
    }
    try:
        doc["timeouts"] = control.get_timeouts()
    except FeatureUnavailable:
        doc["timeouts"] = None
    return doc


def _dumps(value: object) -> str:
    # Event data may carry paths and the like (the JSONL file writes them the same way).
    return json.dumps(value, default=str)


def _json_response(value: object, status: int = 200) -> web.Response:
    return web.json_response(value, status=status, dumps=_dumps)


def _event_accepted(event_id: int, event: dict[str, Any], status: int) -> web.Response:
    return _json_response({"event_id": event_id, "event": event}, status=status)


# -- handlers ---------------------------------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    control = request.app[CONTROL]
    return _json_response({"status": "ok", "state": control.status.state.value})


async def readyz(request: web.Request) -> web.Response:
    status = request.app[CONTROL].status
    running = status.state is DaemonState.RUNNING and all(
        rank.state is RankState.RUNNING for rank in status.ranks
    )
    ranks_running = sum(rank.state is RankState.RUNNING for rank in status.ranks)
    return _json_response(
        {
            "ready": running,
            "state": status.state.value,
            "ranks_running": ranks_running,
            "ranks": len(status.ranks),
        },
        status=200 if running else 503,
    )


async def get_status(request: web.Request) -> web.Response:
    return _json_response(status_document(request.app[CONTROL], request.app[STARTED]))


async def get_cluster(request: web.Request) -> web.Response:
    view = request.app[CONTROL].cluster()
    if inspect.isawaitable(view):
        view = await view
    return _json_response(view)


async def post_restart(request: web.Request) -> web.Response:
    body = _validate(RestartRequest, await _body(request))
    event = request.app[CONTROL].request_restart(
        body.scope, body.reason, _requested_by(request), body.count
    )
    return _event_accepted(event.id, event.to_dict(), 202)


async def post_fault(request: web.Request) -> web.Response:
    body = _validate(FaultRequest, await _body(request))
    if isinstance(body.rank, int) and body.rank < 0:
        raise InvalidRequest("rank: must be >= 0 or 'random'")
    rank = None if body.rank == "random" else body.rank
    event = request.app[CONTROL].inject_fault(body.kind, rank, body.delay_s, _requested_by(request))
    return _event_accepted(event.id, event.to_dict(), 202)


async def exclude_node(request: web.Request) -> web.Response:
    body = _validate(ExcludeRequest, await _body(request))
    event = request.app[CONTROL].exclude_node(
        request.match_info["node_id"], body.reason, _requested_by(request)
    )
    return _event_accepted(event.id, event.to_dict(), 202)


async def readmit_node(request: web.Request) -> web.Response:
    event = request.app[CONTROL].readmit_node(request.match_info["node_id"], _requested_by(request))
    return _event_accepted(event.id, event.to_dict(), 200)


async def get_timeouts(request: web.Request) -> web.Response:
    return _json_response(request.app[CONTROL].get_timeouts())


async def patch_timeouts(request: web.Request) -> web.Response:
    patch = await _body(request)
    if not patch:
        raise InvalidRequest("body: expected at least one timeout to change")
    _check_seconds(patch)
    return _json_response(request.app[CONTROL].set_timeouts(patch, _requested_by(request)))


async def get_events(request: web.Request) -> web.StreamResponse:
    control = request.app[CONTROL]
    since = _int_query(request, "since", 0, 0, 2**63 - 1)
    if "text/event-stream" in request.headers.get("Accept", ""):
        last_event_id = request.headers.get("Last-Event-ID", "").strip()
        if last_event_id.isdigit():
            since = int(last_event_id)  # a reconnecting EventSource resumes after its last id
        return await stream_events(request, control.events, since, request.app[CLOSING])
    limit = _int_query(request, "limit", 1000, 1, MAX_EVENTS_PER_PAGE)
    events = control.events.since(since, limit)
    return _json_response(
        {"events": [event.to_dict() for event in events], "last_id": control.events.last_id}
    )


async def get_metrics(request: web.Request) -> web.Response:
    body, content_type = exposition(request.app[METRICS].registry)
    response = web.Response(body=body)
    response.headers["Content-Type"] = content_type
    return response


def build_app(control: DaemonControl, token: str, reads_need_token: bool) -> web.Application:
    app = web.Application(
        client_max_size=MAX_BODY_BYTES,
        middlewares=[metrics_middleware, error_middleware, auth_middleware],
    )
    app[CONTROL] = control
    app[TOKEN] = token.encode()
    app[READS_NEED_TOKEN] = reads_need_token
    app[CLOSING] = asyncio.Event()
    app[METRICS] = build_registry(control)
    app[STARTED] = time.monotonic()
    app.router.add_get("/healthz", healthz, allow_head=False)
    app.router.add_get("/readyz", readyz, allow_head=False)
    app.router.add_get("/metrics", get_metrics, allow_head=False)
    app.router.add_get("/v1/status", get_status, allow_head=False)
    app.router.add_get("/v1/cluster", get_cluster, allow_head=False)
    app.router.add_post("/v1/restart", post_restart)
    app.router.add_post("/v1/faults", post_fault)
    app.router.add_post("/v1/nodes/{node_id}/exclude", exclude_node)
    app.router.add_delete("/v1/nodes/{node_id}/exclude", readmit_node)
    app.router.add_get("/v1/timeouts", get_timeouts, allow_head=False)
    app.router.add_patch("/v1/timeouts", patch_timeouts)
    app.router.add_get("/v1/events", get_events, allow_head=False)
    add_dashboard_routes(app)
    return app
