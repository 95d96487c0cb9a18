"""`ftd serve`'s arguments: torchrun's flags, ft_launcher's parameters, ftd's own; how they are
split from the script's arguments; and which ones the command line actually set.

Standard library only (the CLI's `--help` must not import pydantic or torch).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ftd.cli.checkpoint_args import add_checkpoint
from ftd.cli.fault_tolerance_args import add_fault_tolerance
from ftd.cli.formatting import HelpFormatter, UsageParser

DEFAULT_API_PORT = 29610  # ftd.config.serve.DEFAULT_API_PORT, without importing pydantic for --help
DEFAULT_PROGRESS_FLOOR_S = 300.0  # ftd.health.progress.DEFAULT_FLOOR_S, likewise
OWN_PROCESS_FROM_RANKS = 1536  # ftd.ranks.workers_store.OWN_PROCESS_FROM_RANKS, likewise
USAGE = "ftd serve [options] training_script [script arguments ...]"


def _flag(*names: str) -> list[str]:
    """torchrun accepts every long flag in kebab and snake case; so does ftd."""
    out: list[str] = []
    for name in names:
        out.append(name)
        if name.startswith("--") and "-" in name[2:]:
            out.append("--" + name[2:].replace("-", "_"))
    return out


def build_serve_parser() -> UsageParser:
    """The parser of what comes before the script: ftd's options and the script's path."""
    parser = UsageParser(prog="ftd serve", **parser_options())
    add_serve_arguments(parser)
    return parser


def parser_options() -> dict[str, Any]:
    """How `ftd serve`'s parser presents itself (here and in `ftd --help`)."""
    return {
        "usage": USAGE,
        "description": SERVE_DESCRIPTION,
        "formatter_class": HelpFormatter,
        "allow_abbrev": False,
    }


SERVE_DESCRIPTION = (
    "Run this node's ranks like torchrun does, restart them on failure, and supervise their "
    "health. Any script that runs under torchrun runs unchanged: everything after the script's "
    "path is passed to it verbatim (one of ftd's own long flags there is the script's too, with "
    "a warning; `--` before the script says that is meant). Every long flag is also accepted in "
    "snake_case (--nproc_per_node), never abbreviated; a mistyped one is an error naming the "
    "closest. Under Slurm and Kubernetes (and with torchrun's PET_* variables) the "
    "node count, node rank, rendezvous endpoint and job id come from the scheduler; explicit "
    "flags win, and --print-config shows where each value came from."
)


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    launch = serve.add_argument_group("launch (torchrun's flags)")
    add = launch.add_argument
    add(*_flag("--nnodes"), default="1:1", metavar="N|MIN:MAX", help="number of nodes")
    add(
        *_flag("--hot-spares"),
        action="store_true",
        help="read --nnodes MIN:MAX as NVRx's ft_launcher does: MIN nodes run the job, the "
        "others wait as hot spares (without it: torchrun's elastic range)",
    )
    add(
        *_flag("--nproc-per-node"),
        default="1",
        metavar="N",
        help="ranks on this node: an integer, or cpu/auto for one per CPU",
    )
    add(*_flag("--standalone"), action="store_true", help="single node: no rendezvous store")
    add(
        *_flag("--rdzv-backend"),
        default="c10d",
        metavar="NAME",
        help="c10d (alias static: a TCPStore hosted by the daemon whose address is the "
        "endpoint's, or by `ftd store`) or etcd (alias etcd-v3: an etcd v3 cluster; no daemon "
        "hosts anything) (default: c10d)",
    )
    add(
        *_flag("--rdzv-endpoint"),
        default="",
        metavar="HOST:PORT",
        help="c10d: the store's host:port (hosted by the node whose address matches it); etcd: "
        "the members, host:port,host:port,... (default: 127.0.0.1:29400)",
    )
    add(
        *_flag("--rdzv-id"),
        *_flag("--run-id"),
        dest="rdzv_id",
        default="none",
        metavar="ID",
        help="job id, and the run directory's name (default: none; a new UUID with --standalone)",
    )
    add(
        *_flag("--rdzv-conf"),
        default="",
        metavar="K=V,...",
        help="rendezvous options: join_timeout, last_call_timeout, list_max (rounds of up to N "
        "nodes listed on every node; 64), secret_file (a 0600 file: signs the daemons' records); "
        "c10d: is_host, host; etcd: protocol, cacert, cert, key, username, password_file (a 0600 "
        "file), prefix, lease_ttl (s, default --node-keepalive-timeout), read_timeout (s; 5)",
    )
    add(*_flag("--max-restarts"), type=int, default=0, metavar="N", help="restarts before failing")
    add(
        *_flag("--monitor-interval"),
        type=float,
        default=0.1,
        metavar="SECONDS",
        help="accepted for torchrun compatibility; ftd sees exits at once (pidfd)",
    )
    add(
        *_flag("--start-method"),
        default="zygote",
        choices=["spawn", "fork", "forkserver", "subprocess", "zygote"],
        help="zygote: fork ranks from a process that imported torch once; the others start "
        "subprocesses as torchrun does",
    )
    add(
        *_flag("--preload"),
        default="",
        metavar="MOD,...",
        help="with --start-method zygote: modules the zygote imports besides torch; `none`: "
        "not even torch (ranks that do not use torch start without its import)",
    )
    add(*_flag("--role"), default="default", metavar="NAME", help="role name of the workers")
    add("-m", *_flag("--module"), action="store_true", help="run the script as `python -m`")
    add(*_flag("--no-python"), action="store_true", help="run the entrypoint as a binary")
    add(
        *_flag("--log-dir"),
        default=None,
        metavar="DIR",
        help="logs, events and status: DIR/<run id>/ (DIR/<node id>/<run id>/ with several "
        "nodes) (default: a new /tmp/ftd_* directory)",
    )
    add(
        "-r",
        *_flag("--redirects"),
        default="0",
        metavar="0-3|RANK:N,...",
        help="write std streams to attempt_<n>/<rank>/{stdout,stderr}.log: 1 out, 2 err, 3 both",
    )
    add(
        "-t",
        *_flag("--tee"),
        default="0",
        metavar="0-3|RANK:N,...",
        help="like --redirects, and still print them",
    )
    add(
        *_flag("--local-ranks-filter"),
        default="",
        metavar="R,...",
        help="only show these local ranks' output (default: all)",
    )
    add(
        *_flag("--master-addr"),
        default=None,
        metavar="HOST",
        help="address the workers' store is hosted on (default: node rank 0's address)",
    )
    add(
        *_flag("--master-port"),
        type=int,
        default=None,
        metavar="PORT",
        help="port of the workers' store (default: a free one)",
    )
    add(
        *_flag("--workers-store-process"),
        default="auto",
        choices=["auto", "on", "off"],
        help="the workers' store in a process of its own, where no job's init stalls the daemon "
        f"(on), on its loop (off), or auto: on from {OWN_PROCESS_FROM_RANKS} ranks (default: auto)",
    )
    add(
        *_flag("--node-rank"),
        type=int,
        default=None,
        metavar="N",
        help="this node's rank in the scheduler's order (SLURM_NODEID, a pod's index): nodes "
        "that give one are ranked by it in every round, so a replacement takes the rank of "
        "the node it replaces (default: the rendezvous ranks nodes as they join)",
    )
    add(
        *_flag("--local-addr"),
        default=None,
        metavar="HOST",
        help="this node's address for the other nodes (default: the host name)",
    )
    add(
        *_flag("--shutdown-timeout"),
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="between the termination signal and SIGKILL when stopping ranks",
    )
    _add_ftd(serve)
    add_fault_tolerance(serve)
    api = serve.add_argument_group("REST API and dashboard")
    add = api.add_argument
    add(*_flag("--api-host"), default="127.0.0.1", metavar="HOST", help="address to bind")
    add(
        *_flag("--api-port"),
        default=None,
        metavar="PORT|0|off",
        help=f"0 picks a free port, off disables the API and its admin socket (default: "
        f"{DEFAULT_API_PORT}, or a free port when another process holds it; a port given here "
        "that is taken is an error)",
    )
    add(
        *_flag("--api-token-file"),
        default=None,
        metavar="FILE",
        help="bearer token file, created 0600 when absent; FTD_API_TOKEN overrides "
        "(default: <run dir>/api.token)",
    )


def _add_ftd(serve: argparse.ArgumentParser) -> None:
    ftd = serve.add_argument_group("ftd")
    add = ftd.add_argument
    add(
        "--print-config",
        "--print_config",
        action="store_true",
        help="print the configuration and where each value came from (flag, scheduler "
        "variable, default), who hosts the rendezvous store, whether the daemons' records are "
        "signed, and what looks wrong (a loopback endpoint for several nodes, an unnamed run), "
        "then exit without starting anything",
    )
    add(*_flag("--node-id"), default=None, metavar="NAME", help="default: the host name")
    add(
        *_flag("--node-keepalive-timeout"),
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="without a keepalive, the other nodes declare a node dead",
    )
    add(
        *_flag("--rdzv-last-call-timeout"),
        type=float,
        default=None,
        metavar="SECONDS",
        help="a round waits this long for more nodes once MIN joined (default: rdzv-conf "
        "last_call_timeout, else 30)",
    )
    add(
        *_flag("--rdzv-join-timeout"),
        type=float,
        default=None,
        metavar="SECONDS",
        help="a round waits this long for MIN nodes before the job fails (default: rdzv-conf "
        "join_timeout, else 600)",
    )
    add(
        *_flag("--termination-signal"),
        default="SIGTERM",
        metavar="SIGNAL",
        help="signal that stops ranks before SIGKILL",
    )
    add(*_flag("--log-level"), default="INFO", metavar="LEVEL", help="the daemon's log level")
    add(
        *_flag("--restart-mode"),
        default="process",
        choices=["process", "inprocess"],
        help="process: stop and restart every rank after a fault; inprocess: announce the "
        "fault to every rank, whose ftd_client.inprocess.Wrapper restarts the training function "
        "in the same process (a rank past its hard timeout falls back to a process restart)",
    )
    add(
        *_flag("--restart-backoff"),
        default="1:60",
        metavar="BASE:CAP[:RESET]",
        help="after attempts that fail fast one after another, wait BASE seconds before the "
        "next, doubling up to CAP; the first restart is immediate, an attempt that ran RESET "
        "seconds (default 300) or made an optimizer step starts over, 0 turns it off "
        "(default: 1:60)",
    )
    add(
        *_flag("--inprocess-respawn"),
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --restart-mode inprocess: start a dead rank's process again so it joins the "
        "next round (counted against --max-restarts); --no-inprocess-respawn: go on without it "
        "(default: respawn)",
    )
    add(
        *_flag("--progress"),
        default="on",
        choices=["on", "off"],
        help="on: every rank reports its optimizer steps, collectives and long phases without "
        "the script's help, and a rank that makes no progress for the learned deadline is "
        "judged hung, the rank the others wait on named the culprit; off: nothing is observed "
        "(default: on)",
    )
    add(
        *_flag("--progress-timeout-floor"),
        type=float,
        default=DEFAULT_PROGRESS_FLOOR_S,
        metavar="SECONDS",
        help="the progress deadline is learned (3x the longest interval between progress "
        "events) but never shorter than this (default: %(default)g)",
    )
    add_checkpoint(add, _flag)
    add(
        *_flag("--enable-fault-injection"),
        action="store_true",
        help="allow POST /v1/faults to kill or hang a rank on purpose (for resilience tests)",
    )


# -- the command line, split and parsed --------------------------------------------------------


@dataclass
class ServeArgs:
    """What `ftd serve ARGV` said: the namespace (defaults filled in), the dests the command
    line set itself, and the script's arguments exactly as given."""

    namespace: argparse.Namespace
    explicit: set[str] = field(default_factory=set)
    unknown: list[str] = field(default_factory=list)
    options: list[str] = field(default_factory=list)
    """Every option string of `ftd serve` (for "did you mean")."""
    after_script: list[str] = field(default_factory=list)
    """ftd's own long flags among the script's arguments: they go to the script, as under
    torchrun, with a warning (none when `--` marked where the script starts)."""


_UNSET: Any = object()


def split_script(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[list[str], int]:
    """(ftd's options, the index of the script's path in argv, or len(argv) when none): ftd's
    options end at the first word that is neither an option nor an option's value, or after
    `--`; what follows the script belongs to the script, byte for byte (torchrun's rule)."""
    actions = parser._option_string_actions
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return list(argv[:i]), i + 1
        if not token.startswith("-") or token == "-":
            return list(argv[:i]), i
        name, equals, _ = token.partition("=")
        action = actions.get(name)
        if action is None and not token.startswith("--") and token[:2] in actions:
            action, equals = actions[token[:2]], "attached"  # -r3
        takes_value = action is not None and action.nargs != 0
        i += 2 if takes_value and not equals else 1
    return list(argv), len(argv)


def parse_serve_argv(argv: Sequence[str]) -> ServeArgs:
    """Parse `ftd serve ...` (the words after `serve`); argparse's usage errors exit 2."""
    parser = build_serve_parser()
    parser.add_argument("training_script", metavar="training_script", help=argparse.SUPPRESS)
    options, script_at = split_script(parser, argv)
    words = options + (["--", argv[script_at]] if script_at < len(argv) else [])
    namespace = argparse.Namespace(
        **{action.dest: _UNSET for action in parser._actions if action.dest != "help"}
    )
    namespace, unknown = parser.parse_known_args(words, namespace)
    explicit = {dest for dest, value in vars(namespace).items() if value is not _UNSET}
    for action in parser._actions:
        if getattr(namespace, action.dest, None) is _UNSET:
            setattr(namespace, action.dest, action.default)
    namespace.training_script_args = list(argv[script_at + 1 :])
    explicit.discard("training_script")
    options = list(parser._option_string_actions)
    marked = 0 < script_at <= len(argv) and argv[script_at - 1] == "--"
    after = [] if marked else ftd_flags(options, namespace.training_script_args)
    return ServeArgs(namespace, explicit, unknown, options, after)


def ftd_flags(options: Sequence[str], script_args: Sequence[str]) -> list[str]:
    """The script's arguments that are one of ftd's long flags (`--nproc-per-node`,
    `--max-restarts=3`), as written before any `=`."""
    flags = {option for option in options if option.startswith("--") and option != "--help"}
    return [name for word in script_args if (name := word.partition("=")[0]) in flags]


def misplaced_warning(flags: Sequence[str], script: str) -> str:
    """One line for ftd flags the operator put after the script."""
    named = ", ".join(flags)
    return (
        f"ftd serve: warning: {named} after the script {script!r} "
        f"{'go' if len(flags) > 1 else 'goes'} to the script (as under torchrun), not to ftd: "
        "put ftd's flags before the script (`--` before the script says its arguments are "
        "meant as they are and silences this)"
    )
