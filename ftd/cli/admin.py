"""`ftd status|restart|exclude|readmit|timeouts|events|top`: operators' commands over the REST API.

Standard library only (through `ftd_client.admin`): these commands never import torch,
pydantic or aiohttp. They reach the daemon over its admin unix socket (found from --run-dir,
else from this user's registry of running daemons) or over TCP with --url. Errors print one
line on stderr and exit 1 (2 for bad usage, or when several daemons run and none was named).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftd_client.admin import AdminClient, AdminError, AmbiguousDaemon, DaemonNotFound

from ftd.cli.event_lines import MAX_VALUE_CHARS, describe_event
from ftd.cli.formatting import EXIT_USAGE, UsageParser, parse_or_exit
from ftd.cli.top import add_top_command, run_top
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
        "admin socket, no token needed (default: the one daemon this user runs)",
    )
    where.add_argument(
        "--token-file",
        "--token_file",
        help="API token file for --url (default: $FTD_API_TOKEN, else the token file the "
        "daemon recorded in --run-dir's api.json)",
    )
    where.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for answers")

    status = subparsers.add_parser("status", parents=[common], help="show nodes and ranks")
    status.add_argument("--json", action="store_true", help="the raw JSON of status and cluster")

    restart = subparsers.add_parser("restart", parents=[common], help="force a restart")
    restart.add_argument("--reason", default="operator request (ftd restart)")
    restart.add_argument("--scope", choices=["cluster", "node"], default="cluster")
    restart.add_argument(
        "--no-count",
        "--no_count",
        dest="count",
        action="store_false",
        help="do not count it against --max-restarts",
    )

    exclude = subparsers.add_parser("exclude", parents=[common], help="exclude a node")
    exclude.add_argument("node", help="node id")
    exclude.add_argument("--reason", default="operator request (ftd exclude)")

    readmit = subparsers.add_parser("readmit", parents=[common], help="re-admit a node")
    readmit.add_argument("node", help="node id")

    timeouts = subparsers.add_parser(
        "timeouts",
        parents=[common],
        help="show or change the rank-health timeouts",
        description="`ftd timeouts` or `ftd timeouts get` shows them; "
        "`ftd timeouts set NAME=SECONDS ...` changes them live.",
    )
    timeouts.add_argument("action", nargs="?", choices=["get", "set"], default="get")
    timeouts.add_argument("changes", nargs="*", metavar="NAME=VALUE")
    timeouts.add_argument("--json", action="store_true")

    events = subparsers.add_parser("events", parents=[common], help="show the event log")
    events.add_argument("--since", type=int, default=None, help="events after this id")
    events.add_argument("--follow", "-f", action="store_true", help="stream new events")
    events.add_argument("--json", action="store_true", help="one JSON object per line")
    add_top_command(subparsers, common)


def admin_main(argv: list[str]) -> int:
    """`ftd <command> ...` for the commands here, with a parser that has only them (the
    serve parser pulls in pydantic)."""
    parser = UsageParser(prog="ftd", description="ftd: operate a running job over its REST API")
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
            if command == "events" and args.run_dir is not None and args.url is None:
                return events_from_file(args)
            raise
        return _HANDLERS[command](client, args)
    except AmbiguousDaemon as error:
        print(f"ftd {command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except AdminError as error:
        print(f"ftd {command}: error: {error}", file=sys.stderr)
        return EXIT_ERROR
    except _Usage as error:
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


EVENTS_FILE = "events.jsonl"


def _event_record(line: str) -> dict[str, Any] | None:
    """An event of events.jsonl; None for a line that is not one (torn, edited, foreign)."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    if not isinstance(event, dict):
        return None
    shape_ok = (
        isinstance(event.get("id"), int)
        and isinstance(event.get("time"), int | float)
        and isinstance(event.get("kind"), str)
        and isinstance(event.get("data", {}), dict)
    )
    return event if shape_ok else None


def events_from_file(args: argparse.Namespace) -> int:
    """`ftd events --run-dir D` when no daemon runs there: the events it left in
    D/events.jsonl (malformed lines skipped and counted)."""
    path = Path(args.run_dir) / EVENTS_FILE
    try:
        lines = path.open(encoding="utf-8", errors="replace")
    except OSError as error:
        raise DaemonNotFound(
            f"no ftd daemon runs on {args.run_dir} and its {EVENTS_FILE} cannot be read "
            f"({error.strerror})"
        ) from None
    following = " (the daemon is gone: not following)" if args.follow else ""
    print(
        f"ftd events: no daemon runs on {args.run_dir}: reading {path}{following}", file=sys.stderr
    )
    show: Callable[[dict[str, Any]], str] = (lambda e: json.dumps(e)) if args.json else format_event
    skipped = 0
    with lines:
        for line in lines:
            event = _event_record(line)
            if event is None:
                skipped += line.strip() != ""
            elif event["id"] > (args.since or 0):
                print(show(event), flush=True)
    if skipped:
        print(f"ftd events: skipped {skipped} malformed lines of {path}", file=sys.stderr)
    return 0


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
        values = client.set_timeouts(**parse_changes(args.changes))
    if args.json:
        print(json.dumps(values, indent=2))
    else:
        for name, value in values.items():
            print(f"{escape(str(name), 60)} = {_seconds(value)}")
    return 0


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


def _value(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    return escape(str(value), MAX_VALUE_CHARS)


def _seconds(value: object) -> str:
    """Timeouts for people: `30`, `none`, `setup:600,step:none`."""
    if isinstance(value, dict):
        return ",".join(f"{escape(str(k), 60)}:{_seconds(v)}" for k, v in value.items()) or "-"
    if value is None:
        return "none"
    return f"{value:g}" if isinstance(value, float) else escape(str(value), MAX_VALUE_CHARS)


def _age(value: object) -> str:
    return f"{value:.1f}s" if isinstance(value, int | float) else "-"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in [header, *rows]
    ]
    return "\n".join(line.rstrip() for line in lines)


def format_status(status: dict[str, Any], cluster: dict[str, Any]) -> str:
    """`ftd status`: every text the daemon reports (names, states, reasons, sections) escaped
    (ftd.text), since ranks and other nodes supply much of it."""
    policy = status.get("policy") or {}
    lines = [
        f"node {_value(status['node_id'])}  run {_value(status['run_id'])}  state "
        f"{_value(status['state'])}  attempt {_value(status['attempt'])}  round "
        f"{_value(status.get('round', status['attempt']))}  restarts "
        f"{_value(status['restart_count'])}/"
        f"{_value(policy.get('max_restarts', status['max_restarts']))}"
        f"  daemon pid {_value(status.get('pid', '-'))}",
    ]
    failure = status.get("last_failure")
    if failure:
        counted = "" if failure.get("counted", True) else ", not counted"
        lines.append(
            f"last failure: {escape(str(failure['reason']), 400)} "
            f"({_value(failure['kind'])}{counted})"
        )
    timeouts = status.get("timeouts")
    if timeouts:
        lines.append(
            "timeouts: "
            + "  ".join(f"{escape(str(k), 60)}={_seconds(v)}" for k, v in timeouts.items())
        )
    lines.append("")
    rows = [
        [
            _value(rank["local_rank"]),
            _value(rank["global_rank"]),
            _value(rank.get("pid")),
            _value(rank["state"]),
            _value(rank.get("exit_code")),
            _age(rank.get("last_heartbeat_age_s")),
            _value(rank.get("section")),
            _age(rank.get("section_age_s")),
        ]
        for rank in status.get("ranks", [])
    ]
    header = ["LOCAL", "RANK", "PID", "STATE", "EXIT", "HEARTBEAT", "SECTION", "FOR"]
    lines.append(_table(header, rows) if rows else "(no ranks)")
    nodes = cluster.get("nodes") or []
    if nodes:
        round_ = cluster.get("round") or {}
        excluded = [
            _value(e if isinstance(e, str) else e.get("node_id", "?"))
            for e in cluster.get("excluded") or []
        ]
        members = [_value(m) for m in round_.get("members") or []]
        lines += [
            "",
            f"cluster: round {_value(round_.get('round', '-'))}, members "
            f"{', '.join(members) or '-'}; excluded {', '.join(excluded) or 'none'}",
        ]
        node_rows = [
            [
                _value(node.get("node_id")),
                _value(node.get("state")),
                _value(node.get("attempt")),
                f"{_value(node.get('restart_count'))}/{_value(node.get('max_restarts'))}",
                str(len(node.get("ranks") or [])) if "ranks" in node else "-",
            ]
            for node in nodes
        ]
        lines.append(_table(["NODE", "STATE", "ATTEMPT", "RESTARTS", "RANKS"], node_rows))
    return "\n".join(lines)


def format_event(event: dict[str, Any]) -> str:
    """One line: id, time, kind and the data that matters for that kind (ftd.cli.event_lines)."""
    return describe_event(event)
