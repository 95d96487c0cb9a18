"""Events and values for a terminal: one line per event (time, kind, the data that matters), with
every control character of the daemon's data made visible by ftd.text.escape, so no event can
move the cursor or retitle the operator's terminal. Standard library only (`ftd events`,
`ftd top`)."""

from __future__ import annotations

import json
import re
import time
from typing import Any

from ftd.status.recovery_stages import AFTER_RESTORE, STAGES
from ftd.text import NO_VALUE, duration, escape

"""Stages shown only where the ranks restored a snapshot (null otherwise: they do not apply)."""
MAX_VALUE_CHARS = 120

KEY_FIELDS: dict[str, tuple[str, ...]] = {
    "daemon_started": ("node_id", "run_id", "pid"),
    "daemon_stopped": ("state",),
    "state_changed": ("previous", "state", "reason"),
    "attempt_started": ("attempt",),
    "attempt_failed": ("attempt",),
    "workers_stopped": ("attempt",),
    "rank_exited": ("attempt", "global_rank", "pid", "state", "exit_code"),
    "rank_hung": ("global_rank", "section"),
    "restart_requested": ("scope", "counted", "by", "reason"),
    "timeouts_changed": ("by",),
    "round_closed": ("round", "group_rank", "members"),
    "cluster_request": ("round", "action", "reason"),
    "job_culprit": ("round", "node_id", "rank", "victim", "reason"),
    "node_excluded": ("node_id", "by", "reason"),
    "node_readmitted": ("node_id", "by"),
    "node_lost": ("node_id", "reason"),
    "standby": ("round", "members"),
    "standby_ended": ("round", "reason", "waited_s"),
    "fault_armed": ("kind", "global_rank", "delay_s"),
    "fault_requested": ("kind", "global_rank", "delay_s", "by"),
    "fault_injected": ("kind", "global_rank"),
    "recovery": ("attempt", "cause"),
}


STACKS_NOTE = re.compile(r"^(Python|native) stacks in (.+)$")
"""A hang's note naming the file its stacks were written to (ftd.health.hangs)."""


def value_text(value: object, key: str = "") -> str:
    """An event field's value; a duration (a key ending in `_s`, not a rate's `_per_s`) by
    ftd.text.duration."""
    is_duration = key.endswith("_s") and not key.endswith("_per_s")
    if is_duration and (isinstance(value, int | float) or value is None):
        return duration(value)
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    if isinstance(value, dict | list):
        return escape(json.dumps(value, default=str, separators=(",", ":")), MAX_VALUE_CHARS)
    return escape(str(value), MAX_VALUE_CHARS)


def timeout_text(value: object) -> str:
    """A timeout setting as the operator gave it: `30`, `off` (none), `setup:600,step:off`;
    the same words in `ftd status`, `ftd top`, `ftd timeouts` and the event lines."""
    if isinstance(value, dict):
        return (
            ",".join(f"{escape(str(k), 60)}:{timeout_text(v)}" for k, v in value.items())
            or NO_VALUE
        )
    if value is None:
        return "off"
    if isinstance(value, float) and not isinstance(value, bool):
        return f"{value:g}"
    return escape(str(value), MAX_VALUE_CHARS)


def timeouts_change(data: dict[str, Any]) -> list[str]:
    """`rank_heartbeat_timeout=30→60 rank_section_timeouts.step=off→180` for a
    `timeouts_changed` event: what changed, before and after (every value when the event has
    no `previous`, as those written before it had)."""
    after = data.get("timeouts") if isinstance(data.get("timeouts"), dict) else {}
    before = data.get("previous") if isinstance(data.get("previous"), dict) else None
    assert isinstance(after, dict)
    words = []
    for name, value in after.items():
        label = escape(str(name), 60)
        if before is None:
            words.append(f"{label}={timeout_text(value)}")
            continue
        old = before.get(name)
        if isinstance(value, dict) or isinstance(old, dict):
            new_map = value if isinstance(value, dict) else {}
            old_map = old if isinstance(old, dict) else {}
            for section in dict.fromkeys([*old_map, *new_map]):
                was, now = old_map.get(section), new_map.get(section)
                if was != now:
                    words.append(
                        f"{label}.{escape(str(section), 60)}="
                        f"{timeout_text(was)}→{timeout_text(now)}"
                    )
        elif old != value:
            words.append(f"{label}={timeout_text(old)}→{timeout_text(value)}")
    return words or (["(no change)"] if before is not None else [])


def cut_middle(text: str, limit: int) -> str:
    """`text` cut to `limit` characters by taking out its middle: its start and its end (where
    a reason says what was done and where its files are) both stay."""
    if len(text) <= limit:
        return text
    head = (limit - 1) // 2
    return text[:head] + "…" + text[len(text) - (limit - 1 - head) :]


def reason_with_stacks(reason: object, notes: object = None) -> list[str]:
    """A hang's or a failure's reason for one line: the files its stacks were written to
    first, whole (`stacks=PATH`), then the rest of the reason cut in the middle."""
    parts = str(reason).split("; ") if reason is not None else []
    if isinstance(notes, list):
        parts += [str(note) for note in notes if str(note) not in parts]
    files = [m.group(2) for m in (STACKS_NOTE.match(part) for part in parts) if m]
    rest = "; ".join(part for part in parts if not STACKS_NOTE.match(part))
    words = [f"stacks={escape(path, 300)}" for path in files]
    if rest:
        words.append(cut_middle(escape(rest), MAX_VALUE_CHARS))
    return words


def stages_text(data: dict[str, Any]) -> str:
    """`detect 4 ms | stop 200 ms | ... = 3.00 s` for a `recovery` event's data."""
    stages = data.get("stages") if isinstance(data.get("stages"), dict) else {}
    assert isinstance(stages, dict)
    parts = [
        f"{name} {duration(stages.get(name))}"
        for name in STAGES
        if name in stages and (name not in AFTER_RESTORE or stages.get(name) is not None)
    ]
    return " | ".join(parts) + f" = {duration(data.get('total_s'))}"


def wall_time(wall_s: object, form: str = "%H:%M:%S", millis: bool = True) -> str | None:
    """A time of day (`12:00:01.250`) for a wall-clock time; None for anything that is not
    one a clock can show (not a number, NaN, beyond the calendar)."""
    if not isinstance(wall_s, int | float) or isinstance(wall_s, bool):
        return None
    try:
        shown = time.strftime(form, time.localtime(wall_s))
        return shown + f".{int((wall_s % 1) * 1000):03d}" if millis else shown
    except (OverflowError, ValueError, OSError):
        return None


def clock(wall_s: object) -> str:
    return wall_time(wall_s) or "??:??:??.???"


def describe_event(event: dict[str, Any], with_id: bool = True) -> str:
    """`   42 12:00:01.250 attempt_failed     attempt=0 rank 1 exited with exit code 1`."""
    kind = str(event.get("kind", "?"))
    data = event.get("data") if isinstance(event.get("data"), dict) else {}
    assert isinstance(data, dict)
    keys = (
        KEY_FIELDS.get(kind)
        or tuple(k for k, v in data.items() if not isinstance(v, dict | list))[:6]
    )
    words = [f"{key}={value_text(data[key], key)}" for key in keys if data.get(key) is not None]
    failure = data.get("failure")
    if kind == "attempt_failed" and isinstance(failure, dict) and "reason" in failure:
        words += reason_with_stacks(failure["reason"])
        if isinstance(failure.get("cause"), str) and failure["cause"]:
            words.append(f"cause={escape(failure['cause'], 300)}")
    if kind == "rank_hung":
        words += reason_with_stacks(data.get("reason"), data.get("notes"))
    if kind == "timeouts_changed":
        words += timeouts_change(data)
    if kind == "attempt_started" and isinstance(data.get("pids"), dict | list):
        words.append(f"ranks={len(data['pids'])}")
    if kind == "recovery":
        words.append(stages_text(data))
    line = f"{clock(event.get('time'))} {escape(kind, 40):<18} {' '.join(words)}".rstrip()
    return f"{value_text(event.get('id', '?')):>5} {line}" if with_id else line
