"""`GET /v1/cluster` with a bound: a page of nodes (`offset`, `limit`: DEFAULT_LIMIT by default,
the round's members alike) and aggregates over all of them (how many in each state and role,
the round's size, the worst stragglers, the nodes whose summaries are oldest, the nodes whose
last attempt failed, the first `limit` excluded nodes), so that the answer stays small at
thousands of nodes (issue 43: at most 64 KiB by default) while nothing is hidden: the rest is a
page away.

Each node's `forward` (its ranks' times, what the straggler watch reads across nodes) is left
out of the page: it is the daemons' input, not the operator's, and it is the part of a summary
that grows with the ranks; its `last_failure` is cut to FAILURE_CHARS.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Any

DEFAULT_LIMIT = 64
MAX_LIMIT = 4096
MAX_OFFSET = 1 << 20
FAILURE_CHARS = 240
"""A node's `last_failure` in the view is cut to this: 64 nodes' reasons of up to 4,000
characters each would not fit 64 KiB."""
WORST = 16
"""Stragglers (by ratio), lagging nodes (by the age of their summary) and failed nodes (the
newest summaries first) listed in full."""


@dataclass(frozen=True)
class Prepared:
    """A cluster view with its aggregates computed (O(N) once), ready to be paged (O(limit))."""

    view: dict[str, Any]
    nodes: list[dict[str, Any]]
    round: dict[str, Any]
    members: list[Any]
    excluded: list[Any]
    aggregates: dict[str, Any]


def prepare(view: dict[str, Any]) -> Prepared:
    """`view` (a coordinator's cluster answer) with the aggregates over every node."""
    nodes = [node for node in _listed(view.get("nodes")) if isinstance(node, dict)]
    stragglers = [s for s in _listed(view.get("stragglers")) if isinstance(s, dict)]
    states = collections.Counter(str(node.get("state")) for node in nodes)
    roles = collections.Counter(str(node.get("role", "active")) for node in nodes)
    timed = [node for node in nodes if _number(node.get("time")) is not None]
    failed = [node for node in timed if node.get("last_failure")]
    given = view.get("round")
    round_: dict[str, Any] = given if isinstance(given, dict) else {}
    aggregates = {
        "total_nodes": len(nodes),
        "counts": {"state": dict(sorted(states.items())), "role": dict(sorted(roles.items()))},
        "stragglers": sorted(stragglers, key=lambda s: -(_number(s.get("ratio")) or 0.0))[:WORST],
        "total_stragglers": len(stragglers),
        "lagging": [
            {"node_id": node.get("node_id"), "time": node.get("time")}
            for node in sorted(timed, key=lambda node: _number(node.get("time")) or 0.0)[:WORST]
        ],
        "failed": [
            {"node_id": node.get("node_id"), "last_failure": _cut(node.get("last_failure"))}
            for node in sorted(failed, key=lambda node: -(_number(node.get("time")) or 0.0))[:WORST]
        ],
        "total_failed": len(failed),
    }
    members = _listed(round_.get("members"))
    return Prepared(view, nodes, round_, members, _listed(view.get("excluded")), aggregates)


def page(prepared: Prepared, offset: int, limit: int) -> dict[str, Any]:
    """Nodes `offset` .. `offset + limit` of a prepared view, with its aggregates."""
    members = prepared.members
    return {
        **prepared.view,
        "round": {
            **prepared.round,
            "members": members[offset : offset + limit],
            "size": len(members),
        },
        "excluded": prepared.excluded[:limit],
        "total_excluded": len(prepared.excluded),
        "nodes": [_shown(node) for node in prepared.nodes[offset : offset + limit]],
        "offset": offset,
        "limit": limit,
        **prepared.aggregates,
    }


def bounded(view: dict[str, Any], offset: int, limit: int) -> dict[str, Any]:
    """`view` (a coordinator's cluster answer) with nodes `offset` .. `offset + limit` and the
    aggregates over every node."""
    return page(prepare(view), offset, limit)


def _shown(node: dict[str, Any]) -> dict[str, Any]:
    shown = {key: value for key, value in node.items() if key != "forward"}
    if "last_failure" in shown:
        shown["last_failure"] = _cut(shown["last_failure"])
    return shown


def _cut(reason: object) -> object:
    """A failure's reason as the view shows it: its start (the node's status has it whole)."""
    return reason[:FAILURE_CHARS] if isinstance(reason, str) else reason


def _listed(value: object) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else []


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None
