"""The cluster's part of `ftd status`: the round, its nodes (a page of them, with how many more
there are), and the job's stragglers; a rank's straggler cell. Standard library only."""

from __future__ import annotations

from typing import Any

from ftd.cli.cells import listed, table, value
from ftd.cli.event_lines import wall_time
from ftd.text import NO_VALUE

AGE_SHOWN_S = 1.0
"""A page's nodes read this long ago or more are said to be (GET /v1/cluster's `view_age_s`:
one read serves the pages asked while it is young)."""


def cluster_lines(status: dict[str, Any], cluster: dict[str, Any]) -> list[str]:
    nodes = [node for node in listed(cluster.get("nodes")) if isinstance(node, dict)]
    if not nodes:
        return []
    round_ = cluster.get("round") if isinstance(cluster.get("round"), dict) else {}
    assert isinstance(round_, dict)
    excluded = [
        value(e if isinstance(e, str) else e.get("node_id", "?"))
        for e in listed(cluster.get("excluded"))
        if isinstance(e, str | dict)
    ]
    members = [value(m) for m in listed(round_.get("members"))]
    policy = status.get("policy") if isinstance(status.get("policy"), dict) else {}
    assert isinstance(policy, dict)
    most = value(policy.get("max_restarts", status.get("max_restarts")))
    rows = [
        [
            value(node.get("node_id")),
            value(node.get("state")),
            value(node.get("attempt")),
            f"{value(node.get('restart_count'))}/{value(node.get('max_restarts', most))}",
            str(len(listed(node.get("ranks")))) if "ranks" in node else NO_VALUE,
            value(node.get("role", "active")),
        ]
        for node in nodes
    ]
    age = cluster.get("view_age_s")
    aged = (
        f" (summaries read {age:.1f} s ago)"
        if isinstance(age, int | float) and not isinstance(age, bool) and age >= AGE_SHOWN_S
        else ""
    )
    return [
        "",
        f"cluster: round {value(round_.get('round'))}, members "
        f"{', '.join(members) or NO_VALUE}; excluded {', '.join(excluded) or 'none'}{aged}",
        *table(["NODE", "STATE", "ATTEMPT", "RESTARTS USED", "RANKS", "ROLE"], rows),
        *more_nodes_lines(cluster, len(nodes)),
        *straggler_lines(cluster),
    ]


def more_nodes_lines(cluster: dict[str, Any], shown: int) -> list[str]:
    """`... and 4032 more nodes (running 4020, restarting 12): GET /v1/cluster?offset=64` where
    the answer is a page of a larger cluster; none otherwise."""
    total = cluster.get("total_nodes")
    if not isinstance(total, int) or isinstance(total, bool) or total <= shown:
        return []
    counts = cluster.get("counts") if isinstance(cluster.get("counts"), dict) else {}
    states = counts.get("state") if isinstance(counts, dict) else None
    by_state = (
        ", ".join(f"{value(state)} {value(n)}" for state, n in list(states.items())[:16])
        if isinstance(states, dict)
        else NO_VALUE
    )
    offset = cluster.get("offset")
    start = offset if isinstance(offset, int) and not isinstance(offset, bool) else 0
    return [
        f"... and {total - shown} more nodes (all {total}: {by_state}): "
        f"GET /v1/cluster?offset={start + shown}"
    ]


def straggler_lines(cluster: dict[str, Any]) -> list[str]:
    """`stragglers: rank 1 on b (1.9x the job's median forward, since 08:20:11)`, if any."""
    named = [
        f"rank {value(s.get('global_rank'))} on {value(s.get('node_id'))} "
        f"({value(s.get('ratio'))}x the job's median "
        f"{SIGNAL_WORDS.get(str(s.get('signal')), 'forward')}, since "
        f"{wall_time(s.get('since'), millis=False) or NO_VALUE})"
        for s in listed(cluster.get("stragglers"))[:16]
        if isinstance(s, dict)
    ]
    return [f"stragglers: {'; '.join(named)}"] if named else []


SIGNAL_WORDS = {"forward": "forward", "host": "host time"}
"""What a straggler is slow in (its `signal`), as the tables say it."""


def straggler_text(progress: object) -> str:
    """`1.9x host since 08:20:11`: the rank is a straggler (its time over the job's median, in
    its forward pass or its host time between steps); NO_VALUE when it is not."""
    straggler = progress.get("straggler") if isinstance(progress, dict) else None
    if not isinstance(straggler, dict) or not isinstance(ratio := straggler.get("ratio"), float):
        return NO_VALUE
    what = SIGNAL_WORDS.get(str(straggler.get("signal")), NO_VALUE)
    return (
        f"{ratio:.1f}x {what} since {wall_time(straggler.get('since'), millis=False) or NO_VALUE}"
    )
