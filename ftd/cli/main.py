"""`ftd` command line: a thin layer over the typed config (torchrun's flags where they overlap)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from ftd.cli.formatting import EXIT_USAGE, UsageParser, options_in_use, unrecognized
from ftd.cli.serve_args import (
    ServeArgs,
    add_serve_arguments,
    misplaced_warning,
    parse_serve_argv,
    parser_options,
)


def _add_serve(subparsers: argparse._SubParsersAction[UsageParser]) -> None:
    """`serve` in `ftd --help`; `main` parses `ftd serve ...` with ftd.cli.serve_args, which keeps
    everything after the script for the script."""
    serve = subparsers.add_parser(
        "serve",
        help="run and supervise this node's ranks (torchrun-compatible)",
        **parser_options(),
    )
    add_serve_arguments(serve)
    serve.add_argument("training_script", help="script (or module, or binary) to run")
    serve.add_argument("training_script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def build_parser() -> UsageParser:
    parser = UsageParser(
        prog="ftd",
        description="ftd: fault-tolerance supervisor for PyTorch jobs",
        allow_abbrev=False,
    )
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=UsageParser)
    _add_serve(subparsers)
    store = subparsers.add_parser(
        "store",
        allow_abbrev=False,
        help="host the rendezvous store (c10d TCPStore) alone, for daemons to share",
    )
    store.add_argument("--host", default="0.0.0.0", help="address to listen on")
    store.add_argument("--port", type=int, default=29400, help="port to listen on")
    from ftd.cli.admin import add_admin_commands  # stdlib only: no torch for `ftd status`

    add_admin_commands(subparsers)
    return parser


def _configure_logging(level: str) -> None:
    from ftd.text import EscapingFormatter  # what ranks and stores said, escaped

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        EscapingFormatter("[ftd %(levelname).1s %(asctime)s %(name)s] %(message)s")
    )
    logging.basicConfig(level=level.upper(), handlers=[handler])


def _run_serve(served: ServeArgs) -> int:
    from ftd.config.resolve import UsageError, apply_scheduler, format_config
    from ftd.config.resolve import serve_config_from_args as resolve

    args = served.namespace
    try:
        detected, sources = apply_scheduler(args, served.explicit, os.environ)
        config = resolve(args)
        if args.log_level.upper() not in logging.getLevelNamesMapping():
            raise UsageError(f"--log-level: unknown level {args.log_level!r}")
        if args.print_config:
            from ftd.cli.serve_notes import print_config_notes

            notes = print_config_notes(config, sources, os.environ)
            print(format_config(config, args, detected, sources, notes))
            return 0
    except UsageError as error:
        from ftd.cli.field_flags import in_flags
        from ftd.cli.serve_args import build_serve_parser

        print(
            f"ftd serve: error: {in_flags(str(error), build_serve_parser(), args)}", file=sys.stderr
        )
        return EXIT_USAGE
    _configure_logging(args.log_level)
    from ftd.cli.serve_notes import log_start_notes

    log_start_notes(config, sources)
    import uvloop

    from ftd.daemon import Daemon

    async def serve() -> int:
        async with Daemon(config) as daemon:
            return await daemon.run()

    from ftd.api import ApiStartupError
    from ftd.errors import StartupError

    try:
        code = uvloop.run(serve())
    except (ApiStartupError, StartupError) as error:  # raised before any rank started
        print(f"ftd serve: error: {error}", file=sys.stderr)
        code = EXIT_USAGE
    _exit_now(code)


def _exit_now(code: int) -> NoReturn:
    """End the daemon without the interpreter's finalization. A store thread can still be
    blocked in a c10d call (a wait on a store whose host has just left); finalization stops
    such a thread inside C++ (pthread_exit's forced unwind), which aborted a daemon whose job
    had succeeded ('terminate called without an active exception', exit -6). The daemon's
    teardown has closed everything it owns; logs and stdio are flushed here."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _run_store(host: str, port: int) -> int:
    """`ftd store`: a TCPStore server until SIGINT/SIGTERM (torch's protocol, no torch)."""
    import asyncio
    import signal

    import uvloop

    from ftd.tcpstore.server import TcpStoreServer

    _configure_logging("INFO")

    async def serve() -> int:
        try:
            store = await TcpStoreServer.start(host, port)
        except OSError as error:
            print(f"ftd store: error: cannot listen on {host}:{port}: {error}", file=sys.stderr)
            return 1
        logging.getLogger("ftd.store").info("rendezvous store listening on %s:%d", host, store.port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await store.close()
        return 0

    return uvloop.run(serve())  # the daemon's loop: its stores run on uvloop too


def _unknown_ft_parameter(unknown: list[str]) -> str | None:
    """A one-line error naming the closest valid name for a mistyped --ft-* flag."""
    from ftd.config.ft import UnknownParameter, check_parameter_name

    for token in unknown:
        if token.startswith("--ft-"):
            name = token.split("=", 1)[0].removeprefix("--ft-").removeprefix("param-")
            try:
                check_parameter_name(name)
            except UnknownParameter as error:
                return str(error)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    from ftd.cli.admin import COMMANDS, admin_main

    words = list(sys.argv[1:] if argv is None else argv)
    if words and words[0] in COMMANDS:  # operators' commands: no torch, no pydantic
        return admin_main(words)
    if words and words[0] == "serve":
        if argv is None:  # this process is the daemon: no secret stays in its environ block
            from ftd.config.secrets import isolate

            isolate()
        served = parse_serve_argv(words[1:])
        if message := _unknown_options(served.unknown, served.options):
            print(f"ftd serve: error: {message}", file=sys.stderr)
            return EXIT_USAGE
        if served.after_script:
            script = served.namespace.training_script
            print(misplaced_warning(served.after_script, script), file=sys.stderr)
        return _run_serve(served)
    parser = build_parser()
    args, unknown = parser.parse_known_args(words)
    if message := _unknown_options(unknown, options_in_use(parser, args)):
        print(f"ftd {args.command}: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "store":
        return _run_store(args.host, args.port)
    parser.error(f"unknown command {args.command!r}")


def _unknown_options(unknown: list[str], options: list[str]) -> str | None:
    if not unknown:
        return None
    return _unknown_ft_parameter(unknown) or unrecognized(unknown, options)
