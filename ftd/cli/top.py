"""`ftd top`: the dashboard's picture in a terminal, refreshed in place (nodes, this node's ranks
with heartbeat ages, steps and step times, the node's steps/s and time lost, the last
recovery's stages, the last events). One plain snapshot, without escape codes, when stdout is
not a terminal. Standard library only.

The picture is a pure function of a `Snapshot` and the terminal's size (`render`); the loop only
fetches, renders and waits for the next refresh or a key (`q` quits).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import select
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from ftd_client.admin import AdminClient, AdminError, DaemonNotFound, read_api_file

from ftd.cli.cells import listed, table
from ftd.cli.event_lines import MAX_VALUE_CHARS, describe_event, stages_text, timeout_text
from ftd.cli.run_files import RunDirError, read_run
from ftd.cli.status_view import (
    RANK_HEADER,
    Ending,
    backoff_text,
    checkpoint_text,
    ending_text,
    progress_text,
    progress_timeout_text,
    rank_rows,
    restarts_text,
    round_text,
    waiting_text,
)
from ftd.text import duration, escape, is_decimal

EVENTS_KEPT = 200
STATE_COLOURS = {
    "running": "32",
    "succeeded": "36",
    "rendezvous": "34",
    "restarting": "33",
    "stopping": "33",
    "failed": "31",
    "stopped": "90",
    "init": "90",
}
ALT_SCREEN_ON, ALT_SCREEN_OFF = "\x1b[?1049h\x1b[?25l", "\x1b[?25h\x1b[?1049l"


def add_top_command(subparsers: argparse._SubParsersAction[Any], common: Any) -> None:
    top = subparsers.add_parser(
        "top",
        parents=[common],
        allow_abbrev=False,
        help="watch the job: nodes, ranks, recoveries, events (q quits)",
        description="The job at a glance, refreshed in place; one plain snapshot when the "
        "output is not a terminal (or with --once).",
    )
    top.add_argument(
        "--interval", type=_interval, default=1.0, help="seconds between refreshes (default: 1)"
    )
    top.add_argument("--once", action="store_true", help="print one snapshot and exit")
    top.add_argument(
        "--events", type=_count, default=8, help="how many recent events to show (default: 8)"
    )


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be between 0.1 and 3600, got {text}")
    return value


def _count(text: str) -> int:
    if not is_decimal(text) or int(text) > EVENTS_KEPT:
        raise argparse.ArgumentTypeError(f"expected 0-{EVENTS_KEPT}, got {text!r}")
    return int(text)


# -- what is shown ----------------------------------------------------------------------------


@dataclass
class Snapshot:
    status: dict[str, Any]
    cluster: dict[str, Any]
    events: list[dict[str, Any]]
    recovery: dict[str, Any] | None = None
    error: str = ""
    """Why the last refresh failed (the picture is then the previous one)."""
    taken_at: float = field(default_factory=time.time)
    ending: Ending | None = None
    """How the run ended, for the picture of a run whose daemon is gone (then final)."""


class Feed:
    """Fetches snapshots, keeping the recent events and the last recovery between refreshes.
    With `run_dir`, a daemon that has gone leaves the run's last picture, said to be final."""

    def __init__(self, client: AdminClient, run_dir: str | None = None) -> None:
        self.client = client
        self.run_dir = run_dir
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=EVENTS_KEPT)
        self.recovery: dict[str, Any] | None = None
        self.cursor: int | None = None
        self.last: Snapshot | None = None

    def _new_events(self) -> None:
        if self.cursor is None:
            last_id = int(self.client.events(limit=1)["last_id"])
            self.cursor = max(0, last_id - EVENTS_KEPT)
        page = self.client.events(since=self.cursor, limit=1000)
        for event in page["events"]:
            if isinstance(event, dict) and isinstance(event.get("id"), int):
                self.events.append(event)
                self.cursor = max(self.cursor, event["id"])
                if event.get("kind") == "recovery":
                    self.recovery = event

    def refresh(self) -> Snapshot:
        """A new snapshot; AdminError only when there has never been one."""
        try:
            status, cluster = self.client.status(), self.client.cluster()
            self._new_events()
        except AdminError as error:
            if self.last is None:
                raise
            final = self._final()
            if final is not None:
                self.last = final
                return final
            self.last.error = str(error)
            return self.last
        self.last = Snapshot(status, cluster, list(self.events), self.recovery)
        return self.last

    def _final(self) -> Snapshot | None:
        """The run's last picture from its files once its daemon is gone (not merely slow to
        answer); None while it may still run or its files cannot be read."""
        if self.run_dir is None:
            return None
        try:
            read_api_file(self.run_dir)
            return None  # its daemon still runs: the last picture stays, with the error
        except DaemonNotFound:
            pass
        except AdminError:
            return None
        try:
            record = read_run(self.run_dir)
        except RunDirError:
            return None
        events = record.events[-EVENTS_KEPT:] or list(self.events)
        recoveries = [e for e in events if e.get("kind") == "recovery"]
        recovery = recoveries[-1] if recoveries else self.recovery
        return Snapshot(record.status, record.cluster, events, recovery, ending=record.ending)


def _paint(text: str, state: str, colour: bool) -> str:
    code = STATE_COLOURS.get(state)
    return f"\x1b[{code}m{text}\x1b[0m" if colour and code else text


def _node_rows(cluster: dict[str, Any], limit: int) -> tuple[list[str], list[list[str]], int]:
    excluded = {
        e if isinstance(e, str) else str(e.get("node_id", "?"))
        for e in listed(cluster.get("excluded"))
        if isinstance(e, str | dict)
    }
    nodes = [n for n in listed(cluster.get("nodes")) if isinstance(n, dict)]
    rows = []
    for node in nodes[:limit]:
        ranks = node.get("ranks")
        if isinstance(node.get("ranks_total"), int):
            up = f"{node.get('ranks_running', '?')}/{node['ranks_total']}"
        elif isinstance(ranks, list):
            running = sum(1 for r in ranks if isinstance(r, dict) and r.get("state") == "running")
            up = f"{running}/{len(ranks)}"
        else:
            up = escape(str(node.get("nproc_per_node", "?")), MAX_VALUE_CHARS)
        rows.append(
            [
                escape(str(node.get("node_id", "?")), 40),
                escape(str(node.get("state", "?")), 20),
                round_text(node, "round", "attempt"),
                round_text(node, "group_rank", "node_rank"),
                up,
                "excluded" if str(node.get("node_id")) in excluded else "",
            ]
        )
    return ["NODE", "STATE", "ROUND", "RANK", "RANKS UP", ""], rows, len(nodes) - len(rows)


def render(snapshot: Snapshot, width: int, height: int, colour: bool, events: int) -> list[str]:
    """The screen: at most `height` lines (0: no limit) of at most `width` characters."""
    s, cluster = snapshot.status, snapshot.cluster
    policy = s.get("policy") if isinstance(s.get("policy"), dict) else {}
    assert isinstance(policy, dict)
    state = escape(str(s.get("state", "?")), 20)
    final = snapshot.ending is not None
    lines = [
        f"ftd top  node {escape(str(s.get('node_id', '?')), 60)}  run "
        f"{escape(str(s.get('run_id', '?')), 60)}  "
        f"{_paint(state.upper() + (' (final)' if final else ''), state, colour)}  "
        f"attempt {round_text(s, 'attempt')}  round {round_text(s, 'round', 'attempt')}  "
        f"{restarts_text(s)}"
        + ("" if final else f"  uptime {duration(s.get('uptime_s'))}")
        + f"  {time.strftime('%H:%M:%S')}",
    ]
    if snapshot.ending is not None:
        lines.append(ending_text(snapshot.ending))
    if snapshot.error:
        lines.append(
            _paint(
                f"! daemon unreachable, showing the last picture: {snapshot.error}",
                "failed",
                colour,
            )
        )
    if countdown := backoff_text(s):
        lines.append(_paint(countdown, "restarting", colour))
    if waiting := waiting_text(s):
        lines.append(_paint(waiting, "rendezvous", colour))
    failure = s.get("last_failure")
    if isinstance(failure, dict):
        lines.append(f"last failure: {escape(str(failure.get('reason', '?')), 200)}")
    counts = collections.Counter(
        str(n.get("state")) for n in listed(cluster.get("nodes")) if isinstance(n, dict)
    )
    round_ = cluster.get("round") if isinstance(cluster.get("round"), dict) else {}
    assert isinstance(round_, dict)
    summary = ", ".join(f"{n} {escape(k, 20)}" for k, n in sorted(counts.items()))
    lines += ["", f"NODES {sum(counts.values())} ({summary})  round {round_.get('round', '-')}"]
    ranks = rank_rows(s)
    event_lines = [describe_event(e, with_id=False) for e in snapshot.events[-events:]][::-1]
    recovery = snapshot.recovery
    fixed = 11 + len(ranks) + len(event_lines) + (2 if recovery else 0)
    room = max(1, height - fixed) if height else 10_000
    header, node_rows, hidden = _node_rows(cluster, room)
    lines += table(header, node_rows)
    if hidden > 0:
        lines.append(f"… {hidden} more nodes (ftd status --json, or the dashboard)")
    lines += ["", f"RANKS of {escape(str(s.get('node_id', '?')), 60)}"]
    lines += table(RANK_HEADER, ranks) if ranks else ["(no ranks)"]
    if progress := progress_text(s):
        lines.append(progress)
    if memory := checkpoint_text(s):
        lines.append(memory)
    timeouts = s.get("timeouts")
    if isinstance(timeouts, dict):
        lines.append(
            "timeouts: "
            + "  ".join(
                f"{escape(str(k), MAX_VALUE_CHARS)}={timeout_text(v)}" for k, v in timeouts.items()
            )
            + progress_timeout_text(s)
        )
    if recovery:
        data = recovery.get("data") if isinstance(recovery.get("data"), dict) else {}
        assert isinstance(data, dict)
        lines += [
            "",
            f"LAST RECOVERY attempt {escape(str(data.get('attempt', '?')), MAX_VALUE_CHARS)}: "
            f"{escape(str(data.get('cause', '?')), 80)}",
            "  " + stages_text(data),
        ]
    if events:
        lines += ["", "EVENTS (newest first)", *event_lines]
    if height:
        lines = lines[:height]
    return [_fit(line, width) for line in lines]


def _fit(line: str, width: int) -> str:
    """Cut to `width` visible characters, the last of them `…`, keeping colour codes whole."""
    if width <= 0 or _visible(line) <= width:
        return line
    out, shown, i = [], 0, 0
    while i < len(line) and shown < width - 1:
        if line.startswith("\x1b[", i):
            end = line.index("m", i) + 1
            out.append(line[i:end])
            i = end
            continue
        out.append(line[i])
        shown += 1
        i += 1
    return "".join(out) + "…" + ("\x1b[0m" if "\x1b[" in line else "")


def _visible(line: str) -> int:
    """How many characters `line` shows: its own colour codes (`\x1b[...m`) take none."""
    if "\x1b[" not in line:
        return len(line)
    shown, i = 0, 0
    while i < len(line):
        if line.startswith("\x1b[", i):
            i = line.index("m", i) + 1
            continue
        shown += 1
        i += 1
    return shown


# -- the loop ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _screen(out: IO[str]) -> Iterator[None]:
    """The alternate screen, cursor hidden, keys without Enter; all restored on the way out."""
    stdin_tty = sys.stdin.isatty()
    saved = None
    if stdin_tty:
        import termios
        import tty

        saved = termios.tcgetattr(sys.stdin.fileno())
        tty.setcbreak(sys.stdin.fileno())
    out.write(ALT_SCREEN_ON)
    out.flush()
    try:
        yield
    finally:
        out.write(ALT_SCREEN_OFF)
        out.flush()
        if saved is not None:
            import termios

            termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, saved)


def _wait_for_key(seconds: float) -> str:
    """The key pressed within `seconds` ('' when none): the refresh tick and the quit key in
    one wait."""
    if not sys.stdin.isatty():
        time.sleep(seconds)
        return ""
    ready, _, _ = select.select([sys.stdin], [], [], seconds)
    return os.read(sys.stdin.fileno(), 32).decode(errors="replace") if ready else ""


def run_top(client: AdminClient, args: argparse.Namespace) -> int:
    feed = Feed(client, args.run_dir if args.url is None else None)
    out = sys.stdout
    if args.once or not out.isatty():
        print("\n".join(render(feed.refresh(), 0, 0, False, args.events)))
        return 0
    with _screen(out):
        while True:
            size = shutil.get_terminal_size()
            lines = render(feed.refresh(), size.columns, size.lines, True, args.events)
            out.write("\x1b[H" + "".join(f"{line}\x1b[K\r\n" for line in lines[:-1]))
            out.write(f"{lines[-1]}\x1b[K\x1b[J" if lines else "\x1b[J")
            out.flush()
            if "q" in _wait_for_key(args.interval).lower():
                return 0
