"""Events and values for a terminal: one line per event (time, kind, the data that matters), with
every control character of the daemon's data made visible by ftd.text.escape, so no event can
move the cursor or retitle the operator's terminal. Standard library only (`ftd events`,
`ftd top`)."""

from __future__ import annotations

import json
import time
from typing import Any

from ftd.text import escape

STAGES = ("detect", "stop", "rendezvous", "spawn", "first_step")
MAX_VALUE_CHARS = 120

KEY_FIELDS: dict[str, tuple[str, ...]] = {
    "daemon_started": ("node_id", "run_id", "pid"),
    "daemon_stopped": ("state",),
    "state_changed": ("previous", "state", "reason"),
    "attempt_started": ("attempt",),
    "attempt_failed": ("attempt",),
    "workers_stopped": ("attempt",),
    "rank_exited": ("attempt", "global_rank", "pid", "state", "exit_code"),
    "rank_hung": ("global_rank", "reason"),
    "restart_requested": ("scope", "counted", "by", "reason"),
    "timeouts_changed": ("by",),
    "round_closed": ("round", "group_rank", "members"),
    "cluster_request": ("round", "action", "reason"),
    "node_excluded": ("node_id", "by", "reason"),
    "node_readmitted": ("node_id", "by"),
    "node_lost": ("node_id", "reason"),
    "fault_armed": ("kind", "global_rank", "delay_s"),
    "fault_requested": ("kind", "global_rank", "delay_s", "by"),
    "fault_injected": ("kind", "global_rank"),
    "recovery": ("attempt", "total_s", "cause"),
}


def value_text(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    if isinstance(value, dict | list):
        return escape(json.dumps(value, default=str, separators=(",", ":")), MAX_VALUE_CHARS)
    return escape(str(value), MAX_VALUE_CHARS)


def seconds_text(value: object) -> str:
    """Durations for people: `4 ms`, `1.80 s`, `2 min 5 s`."""
    if not isinstance(value, int | float) or isinstance(value, bool) or value != value:
        return "-"
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.2f} s" if value < 10 else f"{value:.1f} s"
    return f"{int(value // 60)} min {value % 60:.0f} s"


def stages_text(data: dict[str, Any]) -> str:
    """`detect 4 ms | stop 200 ms | ... = 3.00 s` for a `recovery` event's data."""
    stages = data.get("stages") if isinstance(data.get("stages"), dict) else {}
    assert isinstance(stages, dict)
    parts = [f"{name} {seconds_text(stages.get(name))}" for name in STAGES if name in stages]
    return " | ".join(parts) + f" = {seconds_text(data.get('total_s'))}"


def clock(wall_s: object) -> str:
    if not isinstance(wall_s, int | float) or isinstance(wall_s, bool):
        return "??:??:??.???"
    millis = int((wall_s % 1) * 1000)
    return time.strftime("%H:%M:%S", time.localtime(wall_s)) + f".{millis:03d}"


def describe_event(event: dict[str, Any], with_id: bool = True) -> str:
    """`   42 12:00:01.250 attempt_failed     attempt=0 rank 1 exited with exit code 1`."""
    kind = str(event.get("kind", "?"))
    data = event.get("data") if isinstance(event.get("data"), dict) else {}
    assert isinstance(data, dict)
    keys = (
        KEY_FIELDS.get(kind)
        or tuple(k for k, v in data.items() if not isinstance(v, dict | list))[:6]
    )
    words = [f"{key}={value_text(data[key])}" for key in keys if data.get(key) is not None]
    failure = data.get("failure")
    if kind == "attempt_failed" and isinstance(failure, dict) and "reason" in failure:
        words.append(escape(str(failure["reason"]), MAX_VALUE_CHARS))
    if kind == "attempt_started" and isinstance(data.get("pids"), dict | list):
        words.append(f"ranks={len(data['pids'])}")
    if kind == "recovery":
        words.append(stages_text(data))
    line = f"{clock(event.get('time'))} {escape(kind, 40):<18} {' '.join(words)}".rstrip()
    return f"{value_text(event.get('id', '?')):>5} {line}" if with_id else line
