"""A run directory's own record, for when no daemon answers there: its last status
(status.json) and its events (events.jsonl). Both are read as hostile: regular files of this
user only, size-capped (the status whole, the events line by line or the file's tail), a line
that is not an event skipped and counted. Standard library only (`ftd status`, `ftd events`,
`ftd top` on a finished run)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ftd_client.discovery import NO_WRITE_BY_OTHERS, UnsafeFile, read_checked

from ftd.cli.status_view import TERMINAL_STATES, Ending

STATUS_FILE = "status.json"
EVENTS_FILE = "events.jsonl"
CLUSTER_FILE = "cluster.json"
MAX_STATUS_BYTES = 4 * 1024 * 1024
MAX_EVENT_LINE_BYTES = 1024 * 1024
TAIL_BYTES = 1024 * 1024
"""How much of events.jsonl's end is read for a finished run's ending."""


class RunDirError(Exception):
    """The run directory is not one ftd wrote, or cannot be read: a one-line reason."""


@dataclass
class Record:
    """What a run directory holds of its run."""

    status: dict[str, Any]
    cluster: dict[str, Any]
    events: list[dict[str, Any]]
    """The last events (from the file's tail)."""
    ending: Ending


def event_record(line: str | bytes) -> dict[str, Any] | None:
    """An event of events.jsonl; None for a line that is not one (torn, edited, foreign)."""
    try:
        event = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(event, dict):
        return None
    shape_ok = (
        isinstance(event.get("id"), int)
        and not isinstance(event.get("id"), bool)
        and isinstance(event.get("time"), int | float)
        and isinstance(event.get("kind"), str)
        and isinstance(event.get("data", {}), dict)
    )
    if not shape_ok:
        return None
    event.setdefault("data", {})
    return event


def _json_file(path: Path, max_bytes: int, required: bool) -> dict[str, Any] | None:
    try:
        text = read_checked(path, NO_WRITE_BY_OTHERS, max_bytes)
    except FileNotFoundError:
        if required:
            raise RunDirError(f"no {path}: not the run directory of an ftd job") from None
        return None
    except UnsafeFile as error:
        raise RunDirError(str(error)) from None
    except OSError as error:
        raise RunDirError(f"cannot read {path}: {error.strerror or error}") from None
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise RunDirError(f"{path} is not JSON ({str(error).splitlines()[0][:120]})") from None
    if not isinstance(document, dict):
        raise RunDirError(f"{path} is not an ftd status (a JSON {type(document).__name__})")
    return document


def _open_events(run_dir: Path) -> tuple[int, os.stat_result] | None:
    """events.jsonl opened for reading (a FIFO does not block, a link is not followed): its
    descriptor and stat; None when there is none. RunDirError when it is not a regular file
    of this user."""
    path = run_dir / EVENTS_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise RunDirError(f"cannot read {path}: {error.strerror or error}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        raise RunDirError(f"{path} is not a regular file of this user: refusing to read it")
    return fd, info


def read_events(run_dir: Path) -> Iterator[dict[str, Any] | None]:
    """Every line of the run's events.jsonl as an event, or None for a line that is not one
    (a line over MAX_EVENT_LINE_BYTES included). RunDirError at once when there is no such
    file."""
    opened = _open_events(run_dir)
    if opened is None:
        raise RunDirError(f"no {run_dir / EVENTS_FILE}: not the run directory of an ftd job")
    return _lines(os.fdopen(opened[0], "rb"))


def _lines(file: BinaryIO) -> Iterator[dict[str, Any] | None]:
    with file:
        while line := file.readline(MAX_EVENT_LINE_BYTES + 1):
            if len(line) > MAX_EVENT_LINE_BYTES and not line.endswith(b"\n"):
                while (more := file.readline(MAX_EVENT_LINE_BYTES)) and not more.endswith(b"\n"):
                    pass  # the rest of an over-long line
                yield None
            elif line.strip():
                yield event_record(line)


def last_events(run_dir: Path, max_bytes: int = TAIL_BYTES) -> list[dict[str, Any]]:
    """The events of the last `max_bytes` of events.jsonl (the first, cut line dropped)."""
    opened = _open_events(run_dir)
    if opened is None:
        return []
    fd, info = opened
    with os.fdopen(fd, "rb") as file:
        start = max(0, info.st_size - max_bytes)
        file.seek(start)
        data = file.read(max_bytes)
    lines = data.split(b"\n")
    if start > 0:
        lines = lines[1:]
    return [event for line in lines if line.strip() and (event := event_record(line))]


def ending_of(
    status: dict[str, Any], events: list[dict[str, Any]], written: float | None
) -> Ending:
    """How the run ended: the state its last status records, the reason of its last change
    of state (else of its last failure), when its daemon stopped."""
    state = str(status.get("state", "?"))
    stopped = [e for e in events if e["kind"] == "daemon_stopped"]
    changes = [e for e in events if e["kind"] == "state_changed"]
    if stopped and isinstance(stopped[-1]["data"].get("state"), str):
        state = stopped[-1]["data"]["state"]
    cause = ""
    if changes and changes[-1]["data"].get("state") == state:
        cause = str(changes[-1]["data"].get("reason") or "")
    failure = status.get("last_failure")
    if not cause and isinstance(failure, dict) and state == "failed":
        cause = str(failure.get("reason") or "")
    clean = bool(stopped) and state in TERMINAL_STATES
    return Ending(state, cause, stopped[-1]["time"] if stopped else written, clean)


def read_run(run_dir: str | os.PathLike[str]) -> Record:
    """The run directory's last status, cluster and events, and how it ended."""
    where = Path(run_dir)
    if not where.is_dir():
        raise RunDirError(f"{where} is not a directory (no ftd daemon, and no run's record, there)")
    status = _json_file(where / STATUS_FILE, MAX_STATUS_BYTES, required=True)
    assert status is not None
    cluster = _json_file(where / CLUSTER_FILE, MAX_STATUS_BYTES, required=False) or {}
    events = last_events(where)
    written: float | None
    try:
        written = (where / STATUS_FILE).stat().st_mtime
    except OSError:
        written = None
    ending = ending_of(status, events, written)
    return Record(status, _cluster_view(cluster, status), events, ending)


def _cluster_view(record: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    """cluster.json (`{"round", "members", "size", "excluded"}`; `members` empty at a node of a
    large round, which holds no list) as the API's /v1/cluster shapes it,
    with this node's last state: other nodes' states are not in the run directory."""
    members = record.get("members") if isinstance(record.get("members"), list) else []
    assert isinstance(members, list)
    excluded = record.get("excluded") if isinstance(record.get("excluded"), dict) else {}
    assert isinstance(excluded, dict)
    node_id = status.get("node_id")
    nodes = [
        {
            "node_id": node_id,
            "state": status.get("state"),
            "attempt": status.get("attempt"),
            "restart_count": status.get("restart_count"),
            "ranks": status.get("ranks") or [],
        }
    ]
    return {
        "round": {"round": record.get("round"), "members": members},
        "nodes": nodes,
        "excluded": [{"node_id": str(k), "reason": str(v)} for k, v in excluded.items()],
    }
