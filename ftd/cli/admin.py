"""`ftd status|restart|exclude|readmit|timeouts|events|top`: operators' commands over the REST API.

Standard library only (through `ftd_client.admin`): these commands never import torch,
pydantic or aiohttp. They reach the daemon over its admin unix socket (found from --run-dir,
else from this user's registry of running daemons) or over TCP with --url. Errors print one
line on stderr and exit 1 (2 for bad usage, or when several daemons run and none was named).
Where no daemon answers on --run-dir (the job has ended), `status`, `events` and `top` read
the run's own record instead (ftd.cli.run_files): its last status, said to be final, and its
events; a directory that holds none exits 2.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftd_client.admin import AdminClient, AdminError, AmbiguousDaemon, DaemonNotFound

from ftd.cli.event_lines import describe_event, timeout_text
from ftd.cli.formatting import EXIT_USAGE, UsageParser, parse_or_exit
from ftd.cli.run_files import EVENTS_FILE, RunDirError, read_events, read_run
from ftd.cli.status_view import format_status
from ftd.cli.top import Snapshot, add_top_command, render, run_top
from ftd.text import escape

EXIT_ERROR = 1
COMMANDS = ("status", "restart", "exclude", "readmit", "timeouts", "events", "top")


def add_admin_commands(subparsers: argparse._SubParsersAction[Any]) -> None:
    common = argparse.ArgumentParser(add_help=False)
    where = common.add_argument_group("daemon")
    where.add_argument(
        "--url",
        help="the daemon's API URL, reached over TCP with a token (default: $FTD_API_URL; "
        "without either, the admin socket of --run-dir's daemon)",
    )
    where.add_argument(
        "--run-dir",
        "--run_dir",
        help="the job's run directory (<log dir>/<run id>); its daemon is reached over its "
        "admin socket, no token needed; once the job has ended, status, events and top read "
        "the run's status.json and events.jsonl (default: the one daemon this user runs)",
    )
    where.add_argument(
        "--token-file",
        "--token_file",
        help="API token file for --url (default: $FTD_API_TOKEN, else the token file the "
        "daemon recorded in --run-dir's api.json)",
    )
    where.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for answers")

    status = subparsers.add_parser(
        "status", parents=[common], allow_abbrev=False, help="show nodes and ranks"
    )
    status.add_argument("--json", action="store_true", help="the raw JSON of status and cluster")

    restart = subparsers.add_parser(
        "restart", parents=[common], allow_abbrev=False, help="force a restart"
    )
    restart.add_argument("--reason", default="operator request (ftd restart)")
    restart.add_argument("--scope", choices=["cluster", "node"], default="cluster")
    restart.add_argument(
        "--no-count",
        "--no_count",
        dest="count",
        action="store_false",
        help="do not count it against --max-restarts",
    )

    exclude = subparsers.add_parser(
        "exclude", parents=[common], allow_abbrev=False, help="exclude a node"
    )
    exclude.add_argument("node", help="node id")
    exclude.add_argument("--reason", default="operator request (ftd exclude)")

    readmit = subparsers.add_parser(
        "readmit", parents=[common], allow_abbrev=False, help="re-admit a node"
    )
    readmit.add_argument("node", help="node id")

    timeouts = subparsers.add_parser(
        "timeouts",
        parents=[common],
        allow_abbrev=False,
        help="show or change the rank-health timeouts",
        description="`ftd timeouts` or `ftd timeouts get` shows them; "
        "`ftd timeouts set NAME=SECONDS ...` changes them live.",
    )
    timeouts.add_argument("action", nargs="?", choices=["get", "set"], default="get")
    timeouts.add_argument("changes", nargs="*", metavar="NAME=VALUE")
    timeouts.add_argument("--json", action="store_true")

    events = subparsers.add_parser(
        "events", parents=[common], allow_abbrev=False, help="show the event log"
    )
    events.add_argument("--since", type=int, default=None, help="events after this id")
    events.add_argument("--follow", "-f", action="store_true", help="stream new events")
    events.add_argument("--json", action="store_true", help="one JSON object per line")
    add_top_command(subparsers, common)


def admin_main(argv: list[str]) -> int:
    """`ftd <command> ...` for the commands here, with a parser that has only them (the
    serve parser pulls in pydantic)."""
    parser = UsageParser(
        prog="ftd",
        description="ftd: operate a running job over its REST API",
        allow_abbrev=False,
    )
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=UsageParser)
    add_admin_commands(subparsers)
    args = parse_or_exit(parser, argv)
    return run_admin(args)


def run_admin(args: argparse.Namespace) -> int:
    command: str = args.command
    try:
        try:
            client = connect(args)
        except DaemonNotFound:
            offline = _OFFLINE.get(command)
            if offline is None or args.run_dir is None or args.url is not None:
                raise
            return offline(args)
        return _HANDLERS[command](client, args)
    except AmbiguousDaemon as error:
        print(f"ftd {command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except AdminError as error:
        print(f"ftd {command}: error: {error}", file=sys.stderr)
        return EXIT_ERROR
    except (_Usage, RunDirError) as error:
        print(f"ftd {command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


class _Usage(Exception):
    pass


def connect(args: argparse.Namespace) -> AdminClient:
    """The client the common options ask for: --url over TCP, else --run-dir's (or the one
    running) daemon over its admin socket. DaemonNotFound, AmbiguousDaemon, AdminError."""
    return AdminClient.from_env(args.url, args.run_dir, args.token_file, args.timeout)


# -- a run whose daemon is gone: its run directory's record ------------------------------------


def _gone(command: str, args: argparse.Namespace, what: str) -> None:
    where = escape(str(args.run_dir), 300)
    print(f"ftd {command}: no daemon runs on {where}: {what}", file=sys.stderr)


def status_from_files(args: argparse.Namespace) -> int:
    """`ftd status --run-dir D` when no daemon answers there: the run's last status
    (D/status.json) and how it ended (D/events.jsonl), said to be final."""
    record = read_run(args.run_dir)
    _gone("status", args, "showing the run's last status (its status.json and events.jsonl)")
    if args.json:
        document = {"status": record.status, "cluster": record.cluster, "final": True}
        print(json.dumps({**document, "ending": vars(record.ending)}, indent=2))
        return 0
    print(format_status(record.status, record.cluster, record.ending))
    return 0


def top_from_files(args: argparse.Namespace) -> int:
    """`ftd top --run-dir D` when no daemon answers there: one picture of the run's end."""
    record = read_run(args.run_dir)
    _gone("top", args, "showing the run's last picture (its status.json and events.jsonl)")
    recoveries = [e for e in record.events if e["kind"] == "recovery"]
    snapshot = Snapshot(
        record.status,
        record.cluster,
        record.events,
        recoveries[-1] if recoveries else None,
        ending=record.ending,
    )
    print("\n".join(render(snapshot, 0, 0, False, args.events)))
    return 0


def events_from_file(args: argparse.Namespace) -> int:
    """`ftd events --run-dir D` when no daemon runs there: the events it left in
    D/events.jsonl (lines that are no event, or too long, skipped and counted)."""
    path = Path(args.run_dir) / EVENTS_FILE
    events = read_events(Path(args.run_dir))
    following = " (the daemon is gone: not following)" if args.follow else ""
    _gone("events", args, f"reading {path}{following}")
    show: Callable[[dict[str, Any]], str] = (lambda e: json.dumps(e)) if args.json else format_event
    skipped = 0
    for event in events:
        if event is None:
            skipped += 1
        elif event["id"] > (args.since or 0):
            print(show(event), flush=True)
    if skipped:
        print(f"ftd events: skipped {skipped} malformed lines of {path}", file=sys.stderr)
    return 0


_OFFLINE: dict[str, Callable[[argparse.Namespace], int]] = {
    "status": status_from_files,
    "events": events_from_file,
    "top": top_from_files,
}


def _status(client: AdminClient, args: argparse.Namespace) -> int:
    status = client.status()
    cluster = client.cluster()
    if args.json:
        print(json.dumps({"status": status, "cluster": cluster}, indent=2))
        return 0
    print(format_status(status, cluster))
    return 0


def _restart(client: AdminClient, args: argparse.Namespace) -> int:
    answer = client.restart(args.reason, args.scope, args.count)
    counted = "counted" if args.count else "not counted"
    print(f"restart requested ({args.scope}, {counted}): event {answer['event_id']}")
    return 0


def _exclude(client: AdminClient, args: argparse.Namespace) -> int:
    answer = client.exclude(args.node, args.reason)
    print(f"node {args.node} excluded: event {answer['event_id']}")
    return 0


def _readmit(client: AdminClient, args: argparse.Namespace) -> int:
    answer = client.readmit(args.node)
    print(f"node {args.node} re-admitted: event {answer['event_id']}")
    return 0


def _timeouts(client: AdminClient, args: argparse.Namespace) -> int:
    if args.action == "get":
        if args.changes:
            raise _Usage("`timeouts get` takes no NAME=VALUE (did you mean `timeouts set`?)")
        values = client.timeouts()
    else:
        if not args.changes:
            raise _Usage("`timeouts set` needs at least one NAME=VALUE")
        changes = parse_changes(args.changes)
        try:
            values = client.set_timeouts(**changes)
        except AdminError as error:
            raise AdminError(f"{error}{_closest_timeouts(changes, client)}") from None
    if args.json:
        print(json.dumps(values, indent=2))
    else:
        for name, value in values.items():
            print(f"{escape(str(name), 60)} = {timeout_text(value)}")
    return 0


def _closest_timeouts(changes: dict[str, Any], client: AdminClient) -> str:
    """After a refused change: ` (did you mean rank_heartbeat_timeout?)` for each name the
    daemon does not know, from the names it does (as `timeouts get` shows them); ""."""
    try:
        known = [str(name) for name in client.timeouts()]
    except AdminError:
        return ""
    hints = []
    for name in changes:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hints.append(close[0] if close else f"one of {', '.join(known)}")
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def parse_changes(items: list[str]) -> dict[str, Any]:
    """`rank_heartbeat_timeout=30 rank_out_of_section_timeout=none
    rank_section_timeouts=setup:600,step:180` -> the JSON patch: seconds as numbers, `none`
    as null, `name:seconds,...` as a map; anything else as JSON (or a string, which the
    daemon rejects naming the field)."""
    changes: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not name.strip():
            raise _Usage(f"expected NAME=VALUE, got {item!r}")
        changes[name.strip()] = _parse_value(raw.strip())
    return changes


def _parse_value(raw: str) -> Any:
    if raw.lower() in ("none", "null", "off"):
        return None
    try:
        return json.loads(raw)
    except ValueError:
        pass
    if ":" in raw:
        sections: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in raw.split(","))):
            section, _, seconds = item.partition(":")
            sections[section.strip()] = _parse_value(seconds.strip())
        return sections
    return raw


def _events(client: AdminClient, args: argparse.Namespace) -> int:
    show: Callable[[dict[str, Any]], str] = (lambda e: json.dumps(e)) if args.json else format_event
    page = client.events(since=args.since or 0, limit=10_000)
    backlog = page["events"]
    if args.follow and args.since is None:
        backlog = backlog[-10:]  # like tail -f: the last few, then what comes
    for event in backlog:
        print(show(event), flush=True)
    if args.follow:
        cursor = backlog[-1]["id"] if backlog else page["last_id"]
        for event in client.follow_events(since=cursor):
            print(show(event), flush=True)
    return 0


_HANDLERS: dict[str, Callable[[AdminClient, argparse.Namespace], int]] = {
    "status": _status,
    "restart": _restart,
    "exclude": _exclude,
    "readmit": _readmit,
    "timeouts": _timeouts,
    "events": _events,
    "top": run_top,
}


# -- formatting -------------------------------------------------------------------------------


def format_event(event: dict[str, Any]) -> str:
    """One line: id, time, kind and the data that matters for that kind (ftd.cli.event_lines)."""
    return describe_event(event)
