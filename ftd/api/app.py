"""The aiohttp application: routes, handlers and request models (the middlewares, in
`ftd.api.middlewares`, turn every error into `application/problem+json`).

Everything a request carries is parsed with bounds before use: bodies (size, time to
arrive, nesting, models), query integers (ASCII digits, ranges), `Last-Event-ID`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import os
import re
import time
from collections.abc import Iterable
from typing import Annotated, Any, Literal, TypeVar

from aiohttp import web
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from ftd.api import cluster_view
from ftd.api.connections import ApiLimits, Connections
from ftd.api.control import NodeControl
from ftd.api.dashboard import add_dashboard_routes
from ftd.api.metrics import build_registry, exposition
from ftd.api.middlewares import (
    CONNECTIONS,
    CONTROL,
    HOSTS,
    LIMITS,
    MAX_BODY_BYTES,
    METRICS,
    MIDDLEWARES,
    STARTED,
    STREAMS,
    TOKEN,
    peer_of,
)
from ftd.api.rank_files import add_rank_file_routes, root_exception
from ftd.api.security import HostPolicy
from ftd.api.sse import StreamHub, stream_events
from ftd.errors import InvalidRequest, RequestTimeout
from ftd.status.model import DaemonState, RankState

MAX_EVENTS_PER_PAGE = 10_000
MAX_EVENT_ID = 2**63 - 1
MAX_JSON_DEPTH = 32
"""Request bodies are flat objects; nesting deeper than this is refused before any model
sees it (and a nesting deep enough to exhaust the parser's recursion is refused too)."""
_INTEGER = re.compile(r"-?[0-9]{1,20}")
_EVENT_ID = re.compile(r"[0-9]{1,19}")
NO_CONTROL_CHARACTERS = r"^[^\x00-\x1f\x7f]*$"
"""Free text (reasons) goes into logs and events: no line breaks or terminal escapes."""

M = TypeVar("M", bound=BaseModel)


# -- request models (mirrored by openapi.yaml; a test fails when they drift) -------------------


class RestartRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    scope: Literal["cluster", "node"] = "cluster"
    reason: str = Field("operator request", max_length=1000, pattern=NO_CONTROL_CHARACTERS)
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

    reason: str = Field("operator request", max_length=1000, pattern=NO_CONTROL_CHARACTERS)


# -- helpers ----------------------------------------------------------------------------------


def _no_constants(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _nested_deeper(value: object, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Iterable[object] = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


async def _body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object ({} for an empty body); 400 naming the problem, 408 when
    it does not arrive in time, 413 above the size limit (raised by aiohttp while reading)."""
    timeout_s = request.app[LIMITS].body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise RequestTimeout(f"body: not received within {timeout_s:g} s") from None
    return decode_body(raw)


def decode_body(raw: bytes) -> dict[str, Any]:
    """A request body's JSON object ({} for an empty one), or InvalidRequest naming why not:
    not JSON, not UTF-8, NaN or Infinity, nested deeper than MAX_JSON_DEPTH, not an object.
    The size was bounded by aiohttp (client_max_size) before it got here."""
    if not raw.strip():
        return {}
    too_deep = f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels"
    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except RecursionError:
        raise InvalidRequest(too_deep) from None
    except ValueError as error:  # UnicodeDecodeError included
        raise InvalidRequest(f"body: not valid JSON ({error})") from None
    if _nested_deeper(body, MAX_JSON_DEPTH):
        raise InvalidRequest(too_deep)
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
            message = str(item["msg"]).removeprefix("Value error, ")
            if item["type"] == "string_pattern_mismatch":  # the only pattern: free text
                message = "must not contain control characters (line breaks, escapes)"
            problems.append(f"{field}: {message}")
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
    return f"api {peer_of(request).address}"


def _int_query(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    given = request.query.getall(name, [])
    if not given:
        return default
    if len(given) > 1:
        raise InvalidRequest(f"{name}: given {len(given)} times")
    raw = given[0]
    if not _INTEGER.fullmatch(raw):
        raise InvalidRequest(f"{name}: expected an integer, got {raw[:40]!r}")
    value = int(raw)
    if not low <= value <= high:
        raise InvalidRequest(f"{name}: must be between {low} and {high}, got {value}")
    return value


def status_document(control: NodeControl, started: float) -> dict[str, Any]:
    """`/v1/status`: the node's status (the timeouts in force among it) and its restart policy."""
    doc: dict[str, Any] = control.status_snapshot()
    doc.setdefault("round", doc["attempt"])
    doc["pid"] = os.getpid()
    failure = doc.get("last_failure")
    if isinstance(failure, dict) and failure.get("error_file"):
        failure["exception"] = root_exception(failure["error_file"], failure["timestamp"])
    doc["uptime_s"] = round(time.monotonic() - started, 3)
    doc["policy"] = {
        "restart_policy": control.config.restart_policy,
        "max_restarts": control.config.max_restarts,
        "restarts_left": max(0, control.config.max_restarts - control.status.restart_count),
        "nnodes_min": control.config.nnodes_min,
        "nnodes_max": control.config.nnodes_max,
        "multi_node": control.config.multi_node,
    }
    return doc  # `timeouts`: the board's snapshot has them, as the health service holds them


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
    offset = _int_query(request, "offset", 0, 0, cluster_view.MAX_OFFSET)
    limit = _int_query(request, "limit", cluster_view.DEFAULT_LIMIT, 1, cluster_view.MAX_LIMIT)
    answer = request.app[CONTROL].cluster(offset, limit)
    if inspect.isawaitable(answer):
        answer = await answer
    return _json_response(answer)


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
    event = await request.app[CONTROL].exclude_node(
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


def _last_event_id(request: web.Request) -> int | None:
    """A reconnecting EventSource's last id; None when absent or not an event id."""
    raw = request.headers.get("Last-Event-ID", "").strip()
    if _EVENT_ID.fullmatch(raw) and int(raw) <= MAX_EVENT_ID:
        return int(raw)
    return None


async def get_events(request: web.Request) -> web.StreamResponse:
    control = request.app[CONTROL]
    since = _int_query(request, "since", 0, 0, MAX_EVENT_ID)
    if "text/event-stream" in request.headers.get("Accept", ""):
        resume = _last_event_id(request)
        if resume is not None:
            since = resume  # a reconnecting EventSource resumes after its last id
        return await stream_events(request, control.events, since, request.app[STREAMS])
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


def build_app(
    control: NodeControl,
    token: str,
    hosts: HostPolicy,
    limits: ApiLimits | None = None,
    connections: Connections | None = None,
) -> web.Application:
    """The API for `control`. `hosts` says which Host headers TCP requests may carry (and,
    loopback only, that reads need no token); `connections` are the guarded sites' (none:
    every request is a TCP one)."""
    limits = limits or ApiLimits()
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=MIDDLEWARES)
    app[CONTROL] = control
    app[TOKEN] = token.encode("ascii")
    app[HOSTS] = hosts
    app[LIMITS] = limits
    app[CONNECTIONS] = connections or Connections()
    app[STREAMS] = StreamHub(limits)
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
    add_rank_file_routes(app)
    add_dashboard_routes(app)
    return app
