"""How a node's status reads in a terminal, the same words in `ftd status` and `ftd top`: the
restarts counted one way, the back-off as a countdown, timeouts `off` when none, a missing
value an en dash (NO_VALUE), and a finished run's end as final. Every text the daemon reports
is escaped (ftd.text), since ranks and other nodes supply much of it. Standard library only."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ftd.cli.cells import listed, table, value
from ftd.cli.cluster_lines import cluster_lines, straggler_text
from ftd.cli.event_lines import MAX_VALUE_CHARS, timeout_text, wall_time
from ftd.text import NO_VALUE, duration, escape

MAX_CAUSE_CHARS = 2000

TERMINAL_STATES = ("succeeded", "failed", "stopped")

SHOWN_FIELDS = frozenset(
    {
        *("node_id", "run_id", "state", "attempt", "round", "restart_count", "max_restarts"),
        *("pid", "policy", "backoff_s", "backoff_left_s", "fast_failures", "unhealthy"),
        *("waiting", "connecting", "standby", "last_failure", "timeouts", "progress_deadlines"),
        *("progress", "checkpoint", "ranks"),
    }
)
"""The status fields `ftd status` says in its own words, and LEFT_OUT those it leaves out on
purpose; any other is shown as `name: value` (other_lines), so a new field needs no change
here."""
LEFT_OUT = frozenset({"restart_policy", "ipc", "last_recovery", "uptime_s"})
"""In `policy`; the socket's counters (`ftd top`); the recovery (its events); the uptime."""


@dataclass(frozen=True)
class Ending:
    """How a run whose daemon is gone ended, from its run directory's files."""

    state: str
    cause: str
    """The reason of its last change of state (else its last failure's), or ""."""
    at: float | None
    """When its daemon stopped (its `daemon_stopped` event), else when the status was written."""
    clean: bool
    """Whether the daemon said it stopped (a `daemon_stopped` event after the status)."""


def restarts_text(status: dict[str, Any]) -> str:
    """`restarts 2/3 used`: the restarts counted against --max-restarts, the one count of
    restarts every CLI surface shows (a restart not counted, such as `ftd restart --no-count`
    or a lost node's, is not in it; the attempt number grows with every restart)."""
    policy = status.get("policy") if isinstance(status.get("policy"), dict) else {}
    assert isinstance(policy, dict)
    most = policy.get("max_restarts", status.get("max_restarts"))
    return f"restarts {value(status.get('restart_count'))}/{value(most)} used"


def backoff_text(status: dict[str, Any]) -> str:
    """`restarting in 3.2 s (back-off after 3 fast failures)` while the daemon waits before
    the next attempt; "" otherwise."""
    left = status.get("backoff_left_s")
    if status.get("state") != "restarting" or not isinstance(left, int | float) or left <= 0:
        return ""
    fast = status.get("fast_failures")
    after = (
        f"after {fast} fast failures in a row"
        if isinstance(fast, int) and not isinstance(fast, bool) and fast > 1
        else "after fast failures"
    )
    return (
        f"restarting in {duration(left)} (back-off {after}; wait "
        f"{duration(status.get('backoff_s'))}, --restart-backoff)"
    )


def round_text(node: dict[str, Any], key: str, fallback: str = "") -> str:
    """A node's round or node rank: NO_VALUE while it has none (during a rendezvous: `joining`)."""
    item = node.get(key, node.get(fallback)) if fallback else node.get(key)
    if item is None:
        return "joining" if node.get("state") in ("rendezvous", "init") else NO_VALUE
    return escape(str(item), MAX_VALUE_CHARS)


def ending_text(ending: Ending) -> str:
    """`the job failed at 04:43:22 (its daemon stopped): rank 0 ... exit code 3; ...`."""
    when = wall_time(ending.at, "%Y-%m-%d %H:%M:%S", millis=False) or "an unknown time"
    cause = f": {escape(ending.cause, 1000)}" if ending.cause else ""
    if ending.state in TERMINAL_STATES:
        how = "its daemon stopped" if ending.clean else "its daemon is gone"
        return f"the job {value(ending.state)} at {when} ({how}){cause}"
    return (
        f"the daemon is gone without saying it stopped: the last state it recorded was "
        f"{value(ending.state)} at {when} (killed, or its machine stopped){cause}"
    )


def rank_rows(status: dict[str, Any]) -> list[list[str]]:
    return [
        [
            value(rank.get("local_rank")),
            value(rank.get("global_rank")),
            value(rank.get("pid")),
            value(rank.get("state")),
            value(rank.get("exit_code")),
            duration(rank.get("last_heartbeat_age_s")),
            value(rank.get("section")),
            duration(rank.get("section_age_s")) if rank.get("section") else NO_VALUE,
            progress_age_text(rank.get("progress")),
            *_progress_cells(rank.get("progress")),
            straggler_text(rank.get("progress")),
        ]
        for rank in listed(status.get("ranks"))
        if isinstance(rank, dict)
    ]


RANK_HEADER = [
    "LOCAL",
    "RANK",
    "PID",
    "STATE",
    "EXIT",
    "HEARTBEAT",
    "SECTION",
    "FOR",
    "NO PROGRESS",
    "STEPS",
    "STEP TIME",
    "STRAGGLER",
]


def progress_age_text(progress: object) -> str:
    """`12.0 s / 5 min 0 s`: the time a rank is counted without progress against the deadline
    that judges it (`in auto:torch.save` inside an automatic section); NO_VALUE where nothing
    is timed (before the node's first step, --progress off)."""
    if not isinstance(progress, dict):
        return NO_VALUE
    age, limit = progress.get("progress_deadline_age_s"), progress.get("progress_deadline_s")
    if not isinstance(age, int | float) or not isinstance(limit, int | float):
        return NO_VALUE
    name = progress.get("progress_deadline_name")
    inside = f" in {escape(str(name), 60)}" if name not in (None, "progress") else ""
    return f"{duration(age)} / {duration(limit)}{inside}"


def progress_timeout_text(status: dict[str, Any]) -> str:
    """`  progress=300` (or `=off`) for the timeouts line: the progress deadline is a verdict in
    force beside the timeouts; "" where the status does not say."""
    deadlines = status.get("progress_deadlines")
    if not isinstance(deadlines, dict):
        return ""
    deadline = deadlines.get("deadline_s") if deadlines.get("enabled") is True else None
    return f"  progress={timeout_text(deadline)}"


def _progress_cells(progress: object) -> list[str]:
    """A rank's optimizer steps and median step time (what its progress report says)."""
    if not isinstance(progress, dict):
        return [NO_VALUE, NO_VALUE]
    steps = progress.get("steps")
    shown = str(steps) if isinstance(steps, int) and not isinstance(steps, bool) else NO_VALUE
    return [shown, duration(progress.get("step_time_s"))]


def progress_text(status: dict[str, Any]) -> str:
    """`progress: 1200 steps, 3.21 steps/s, making steps 6 min 14 s, time lost 41.2 s since
    09:12:03` (the node's slowest rank; docs/api.md, "Progress"); "" before the job began."""
    progress = status.get("progress")
    if not isinstance(progress, dict) or wall_time(progress.get("since")) is None:
        return ""
    rate = progress.get("steps_per_s")
    pace = f"{rate:.2f}" if isinstance(rate, int | float) and not isinstance(rate, bool) else None
    return (
        f"progress: {value(progress.get('steps'))} steps, {pace or NO_VALUE} steps/s, making "
        f"steps {duration(progress.get('making_steps_s'))}, time lost "
        f"{duration(progress.get('time_lost_s'))} since "
        f"{wall_time(progress.get('since'), millis=False)}"
    )


def format_status(
    status: dict[str, Any], cluster: dict[str, Any], ending: Ending | None = None
) -> str:
    """`ftd status`: the node, its last failure, its timeouts, its ranks and the cluster;
    with `ending`, the last status of a run whose daemon is gone, said to be final."""
    state = value(status.get("state"))
    head = [
        f"node {value(status.get('node_id'))}",
        f"run {value(status.get('run_id'))}",
        f"state {state}{' (final)' if ending is not None else ''}",
        f"attempt {value(status.get('attempt'))}",
        f"round {round_text(status, 'round', 'attempt')}",
        restarts_text(status),
    ]
    if ending is None:
        head.append(f"daemon pid {value(status.get('pid'))}")
    lines = ["  ".join(head)]
    if ending is not None:
        lines.append(ending_text(ending))
    if countdown := backoff_text(status):
        lines.append(countdown)
    if unhealthy := status.get("unhealthy"):
        lines.append(f"unhealthy, sitting out of the rendezvous: {escape(str(unhealthy), 400)}")
    if waiting := waiting_text(status):
        lines.append(waiting)
    if isinstance(standby := status.get("standby"), dict):
        since = wall_time(standby.get("since"), millis=False) or NO_VALUE
        lines.append(f"{escape(str(standby.get('reason')), 400)} (since {since})")
    failure = status.get("last_failure")
    if isinstance(failure, dict):
        counted = "" if failure.get("counted", True) else ", not counted"
        lines.append(
            f"last failure: {escape(str(failure.get('reason')), 400)} "
            f"({value(failure.get('kind'))}{counted})"
        )
        lines += cause_lines(failure.get("cause"))
    timeouts = status.get("timeouts")
    if isinstance(timeouts, dict) and timeouts:
        lines.append(
            "timeouts: "
            + "  ".join(f"{escape(str(k), 60)}={timeout_text(v)}" for k, v in timeouts.items())
            + progress_timeout_text(status)
        )
    if progress := progress_text(status):
        lines.append(progress)
    if memory := checkpoint_text(status):
        lines.append(memory)
    lines += other_lines(status)
    lines.append("")
    rows = rank_rows(status)
    lines += table(RANK_HEADER, rows) if rows else ["(no ranks)"]
    lines += cluster_lines(status, cluster)
    return "\n".join(lines)


def waiting_text(status: dict[str, Any]) -> str:
    """`waiting for nodes in round 3: 1 of 2 joined (a); missing: b; gives up in 583 s` while
    the node waits in a round for others to join (`waiting`), `connecting to h:29400: name or
    service not known (4 tries); gives up in 597 s` while it reaches for the rendezvous
    (`connecting`); "" otherwise."""
    wait = status.get("waiting")
    if isinstance(reach := status.get("connecting"), dict):
        tries = reach.get("tries")
        error = reach.get("last_error")
        said = f"{escape(error, 300)} ({value(tries)} tries)" if isinstance(error, str) else ""
        return (
            f"connecting to {value(reach.get('endpoint'))}: {said or 'no answer yet'}; gives up "
            f"in {seconds_left(reach.get('left_s'))}"
        )
    if not isinstance(wait, dict):
        return ""
    joined = [value(n) for n in listed(wait.get("joined"))[:64]]
    missing = [value(n) for n in listed(wait.get("missing"))[:64]]
    count = wait.get("joined_count")
    how_many = count if type(count) is int and count >= len(joined) else len(joined)
    named = ", ".join([*joined, *(["..."] if how_many > len(joined) else [])])
    wanted = value(wait.get("nnodes_min"))
    if wait.get("nnodes_max") != wait.get("nnodes_min"):
        wanted += f" to {value(wait.get('nnodes_max'))}"
    return (
        f"waiting for nodes in round {value(wait.get('round'))} at "
        f"{value(wait.get('endpoint'))}: {how_many} of {wanted} joined "
        f"({named or 'none'}); missing: {', '.join(missing) or 'none'}; gives up "
        f"in {seconds_left(wait.get('left_s'))}"
    )


def seconds_left(left: object) -> str:
    return f"{left:.0f} s" if isinstance(left, int | float) else NO_VALUE


def cause_lines(cause: object) -> list[str]:
    """`cause: FileNotFoundError: ...`: what the job said of its failure (several lines of a
    rank's stderr indented under it); none without one."""
    if not isinstance(cause, str) or not cause.strip():
        return []
    first, *rest = escape(cause.strip(), MAX_CAUSE_CHARS, lines=True).splitlines() or [""]
    return [f"cause: {first}", *(f"  {line}" for line in rest)]


def checkpoint_text(status: dict[str, Any]) -> str:
    """`snapshots: step 60 in memory (24.0 MiB of 8.0 GiB), 1 step lost; last restore after
    step 49 (1 lost)`: the memory tier (docs/checkpoint.md); '' without it. With
    --checkpoint-every: `, every 8 steps (auto)` after the steps lost."""
    memory = status.get("checkpoint")
    if not isinstance(memory, dict) or not memory.get("budget_bytes"):
        return ""
    newest = memory.get("newest_step")
    text = (
        f"snapshots: {'no step' if newest is None else f'step {value(newest)}'} in memory "
        f"({size_text(memory.get('memory_bytes'))} of {size_text(memory.get('budget_bytes'))}), "
        f"{value(memory.get('steps_lost'))} steps lost"
    )
    every = memory.get("every")
    if every is not None and every != 1:  # `, every 8 steps (auto)`: --checkpoint-every
        interval = every if isinstance(every, int) else memory.get("interval_steps")
        text += f", every {value(interval)} steps" + (" (auto)" if every == "auto" else "")
    replica = memory.get("replica")
    if isinstance(replica, dict):  # `, replica on b 0 steps behind`
        text += (
            f", replica on {value(replica.get('successor'))} "
            f"{value(memory.get('replica_lag_steps'))} steps behind"
        )
    last = memory.get("last_restore")
    if isinstance(last, dict):
        text += (
            f"; last restore after step {value(last.get('step'))}"
            f"{' from disk' if last.get('source') == 'disk' else ''} "
            f"({value(last.get('steps_lost'))} lost)"
        )
    return text


def size_text(size: object) -> str:
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return NO_VALUE
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):.1f} {unit}"
    return f"{size} B"


def other_lines(status: dict[str, Any]) -> list[str]:
    """`name: value` (its `reason` where it has one) for each status field not shown otherwise
    (SHOWN_FIELDS, LEFT_OUT) and not null: a new field, or what a newer daemon says."""
    lines = []
    for name, item in status.items():
        if name in SHOWN_FIELDS or name in LEFT_OUT or item is None:
            continue
        if isinstance(item, dict) and isinstance(item.get("reason"), str):
            item = item["reason"]
        text = item if isinstance(item, str) else json.dumps(item, default=str)
        lines.append(f"{escape(str(name), 60).replace('_', ' ')}: {escape(text, 400)}")
    return lines[:32]
