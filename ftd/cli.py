"""`ftd` command line: a thin layer over the typed config (torchrun's flags where they overlap)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid
from collections.abc import Sequence
from typing import NoReturn

from ftd.errors import format_validation_error

EXIT_USAGE = 2
DEFAULT_API_PORT = 29610  # ftd.config.DEFAULT_API_PORT, without importing pydantic for --help


class UsageError(Exception):
    """Bad input on the command line: one line on stderr and exit code 2, nothing started."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _flag(*names: str) -> list[str]:
    """torchrun accepts every long flag in kebab and snake case; so does ftd."""
    out: list[str] = []
    for name in names:
        out.append(name)
        if name.startswith("--") and "-" in name[2:]:
            out.append("--" + name[2:].replace("-", "_"))
    return out


def _add_serve(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="run and supervise this node's ranks (torchrun-compatible)",
        description="Run this node's ranks like torchrun does, restart them on failure, and "
        "supervise their health. Any script that runs under torchrun runs unchanged.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = serve.add_argument
    launch = serve.add_argument_group("launch (torchrun's flags)")
    add = launch.add_argument
    add(*_flag("--nnodes"), default="1:1", help="number of nodes, or MIN:MAX")
    add(
        *_flag("--nproc-per-node"),
        default="1",
        help="ranks on this node: an integer, or 'cpu'/'auto' for one per CPU",
    )
    add(*_flag("--standalone"), action="store_true", help="single node: host the store locally")
    add(
        *_flag("--rdzv-backend"),
        default="c10d",
        help="rendezvous backend: c10d (alias static; a TCPStore, hosted by the daemon whose "
        "address is the endpoint's, or by `ftd store`) or etcd (alias etcd-v3; an etcd v3 "
        "cluster, no daemon hosts anything)",
    )
    add(
        *_flag("--rdzv-endpoint"),
        default="",
        help="c10d: the store's host:port; etcd: the members, host:port,host:port,...",
    )
    add(*_flag("--rdzv-id"), *_flag("--run-id"), dest="rdzv_id", default="none", help="job id")
    add(
        *_flag("--rdzv-conf"),
        default="",
        help="rendezvous options, key1=v1,key2=v2: join_timeout, last_call_timeout, "
        "secret_file (a 0600 file: signs the daemons' records); c10d: is_host, host; etcd: "
        "protocol, cacert, cert, key, username, password_file (a 0600 file), prefix, "
        "lease_ttl (s, default --node-keepalive-timeout), read_timeout (s, default 5)",
    )
    add(*_flag("--max-restarts"), type=int, default=0, help="restarts before the job fails")
    add(
        *_flag("--monitor-interval"),
        type=float,
        default=0.1,
        help="accepted for torchrun compatibility; ftd sees exits at once (pidfd)",
    )
    add(
        *_flag("--start-method"),
        default="zygote",
        choices=["spawn", "fork", "forkserver", "subprocess", "zygote"],
        help="how ranks are started: as subprocesses, as under torchrun (spawn, fork, "
        "forkserver, subprocess), or forked from a zygote that imported torch once (zygote)",
    )
    add(
        *_flag("--preload"),
        default="",
        help="with --start-method zygote: modules the zygote imports besides torch, mod1,mod2",
    )
    add(*_flag("--role"), default="default", help="role name of the workers")
    add("-m", *_flag("--module"), action="store_true", help="run the script as `python -m`")
    add(*_flag("--no-python"), action="store_true", help="run the entrypoint as a binary")
    add(*_flag("--log-dir"), default=None, help="per-attempt logs: <dir>/<run id>/attempt_<n>/")
    add("-r", *_flag("--redirects"), default="0", help="std streams to files: 0-3 or rank:N,...")
    add("-t", *_flag("--tee"), default="0", help="tee std streams to files and console: 0-3")
    add(*_flag("--local-ranks-filter"), default="", help="only show these local ranks' output")
    add(*_flag("--master-addr"), default=None, help="address the workers' store is hosted on")
    add(*_flag("--master-port"), type=int, default=None, help="port of the workers' store")
    add(*_flag("--node-rank"), type=int, default=0, help="accepted for torchrun compatibility")
    add(*_flag("--local-addr"), default=None, help="this node's address for the other nodes")
    add(
        *_flag("--shutdown-timeout"),
        type=float,
        default=5.0,
        help="seconds between the termination signal and SIGKILL when stopping ranks",
    )
    ftd = serve.add_argument_group("ftd")
    add = ftd.add_argument
    add(*_flag("--node-id"), default=None, help="this node's name (default: the host name)")
    add(
        *_flag("--node-keepalive-timeout"),
        type=float,
        default=5.0,
        help="seconds without a keepalive before the other nodes declare a node dead",
    )
    add(
        *_flag("--rdzv-last-call-timeout"),
        type=float,
        default=None,
        help="seconds a round waits for more nodes once MIN joined [rdzv-conf last_call_timeout, "
        "else 30]",
    )
    add(
        *_flag("--rdzv-join-timeout"),
        type=float,
        default=None,
        help="seconds a round waits for MIN nodes before the job fails [rdzv-conf join_timeout, "
        "else 600]",
    )
    add(
        *_flag("--termination-signal"),
        default="SIGTERM",
        help="signal that stops ranks before SIGKILL",
    )
    add(*_flag("--log-level"), default="INFO", help="the daemon's log level")
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
        "next, doubling up to CAP (the first restart is immediate); an attempt that ran RESET "
        "seconds (default 300) starts over; 0 turns it off",
    )
    add(
        *_flag("--inprocess-respawn"),
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --restart-mode inprocess: start a dead rank's process again so it joins the "
        "next round (counted against --max-restarts); --no-inprocess-respawn: go on without it",
    )
    _add_fault_tolerance(serve)
    serve.add_argument(
        *_flag("--enable-fault-injection"),
        action="store_true",
        help="allow POST /v1/faults to kill or hang a rank on purpose (for resilience tests)",
    )
    api = serve.add_argument_group("REST API")
    add = api.add_argument
    add(*_flag("--api-host"), default="127.0.0.1", help="address the API binds to")
    add(
        *_flag("--api-port"),
        default=str(DEFAULT_API_PORT),
        help="API port; 0 picks a free one, 'off' disables the API",
    )
    add(
        *_flag("--api-token-file"),
        default=None,
        help="bearer token file (created 0600 when absent; default <run dir>/api.token); "
        "FTD_API_TOKEN overrides",
    )
    serve.add_argument("training_script", help="script (or module, or binary) to run")
    serve.add_argument("training_script_args", nargs=argparse.REMAINDER)


FT_HELP = {
    "initial_rank_heartbeat_timeout": "seconds from a rank's handshake to its first heartbeat",
    "rank_heartbeat_timeout": "seconds allowed between heartbeats",
    "rank_section_timeouts": "per-section seconds, e.g. setup:600,step:180,checkpointing:420",
    "rank_out_of_section_timeout": "seconds allowed outside any section",
    "safety_factor": "learned timeout = longest observed interval x this",
    "min_learned_timeout": "seconds no learned timeout goes below (default 1)",
    "rank_termination_signal": "signal for a hung rank (after its stacks are dumped)",
    "log_level": "log level of the rank-health components",
    "calc_timeouts": "learn timeouts automatically at the end of every attempt",
    "workload_check_interval": "accepted for compatibility (ftd checks deadlines as they fall due)",
}


def _add_fault_tolerance(serve: argparse.ArgumentParser) -> None:
    from ftd.ft_config import DELEGATED_PARAMETERS, KNOWN_PARAMETERS

    group = serve.add_argument_group(
        "fault tolerance (ft_launcher's parameters)",
        "Each parameter NAME is accepted as --ft-param-NAME=VALUE (ft_launcher's seed form) "
        "and as --ft-NAME VALUE (current ft_launcher; kebab or snake case). 'None' disables "
        "a timeout. CLI values override the YAML file. ft_launcher parameters that mean nothing "
        "to ftd (GPU, NIC and storage checks) are accepted and ignored.",
    )
    add = group.add_argument
    add(
        "--ft-cfg-path",
        "--ft_cfg_path",
        "--fault-tol-cfg-path",
        "--fault_tol_cfg_path",
        dest="ft_cfg_path",
        default=None,
        help="YAML file with a fault_tolerance section",
    )
    add(
        "--restart-policy",
        "--restart_policy",
        "--ft-restart-policy",
        "--ft_restart_policy",
        "--ft-param-restart_policy",
        dest="restart_policy",
        choices=["any-failed", "min-healthy"],
        default=None,
        help="any-failed: restart every node's workers; min-healthy: only below MIN nodes "
        "[default: any-failed]",
    )
    add(
        "--ft-state-file",
        "--ft_state_file",
        "--ft-param-state_file",
        dest="ft_state_file",
        default=None,
        help="learned timeouts persist here [default: <run dir>/ft_state.json]",
    )
    for name in sorted(KNOWN_PARAMETERS - set(DELEGATED_PARAMETERS)):
        kebab = name.replace("_", "-")
        spellings = {f"--ft-param-{name}", f"--ft-param-{kebab}", f"--ft-{kebab}", f"--ft-{name}"}
        add(
            f"--ft-param-{name}",
            *sorted(spellings - {f"--ft-param-{name}"}),
            dest=f"ft__{name}",
            default=None,
            metavar="VALUE",
            help=FT_HELP.get(name, argparse.SUPPRESS),
        )


def build_parser() -> _Parser:
    parser = _Parser(prog="ftd", description="ftd: fault-tolerance supervisor for PyTorch jobs")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_serve(subparsers)
    store = subparsers.add_parser(
        "store", help="host the rendezvous store (c10d TCPStore) alone, for daemons to share"
    )
    store.add_argument("--host", default="0.0.0.0", help="address to listen on")
    store.add_argument("--port", type=int, default=29400, help="port to listen on")
    from ftd.admin_cli import add_admin_commands  # stdlib only: no torch for `ftd status`

    add_admin_commands(subparsers)
    return parser


def _nproc(value: str) -> int:
    if value in ("cpu", "auto"):
        return os.cpu_count() or 1
    try:
        return int(value)
    except ValueError:
        raise UsageError(
            f"--nproc-per-node: expected an integer or cpu/auto, got {value!r}"
        ) from None


def serve_config_from_args(args: argparse.Namespace) -> object:
    """The ServeConfig for `ftd serve` arguments; UsageError naming the field when invalid."""
    from pydantic import ValidationError

    from ftd.config import ServeConfig, parse_nnodes, parse_rdzv_conf

    try:
        nnodes_min, nnodes_max = parse_nnodes(args.nnodes)
        rdzv_conf = parse_rdzv_conf(args.rdzv_conf)
        ranks_filter = (
            frozenset(int(r) for r in args.local_ranks_filter.split(","))
            if args.local_ranks_filter
            else None
        )
    except ValueError as error:
        message = str(error).replace("invalid literal for int() with base 10", "bad local rank")
        raise UsageError(message) from None
    run_id = args.rdzv_id
    if args.standalone and run_id == "none":
        run_id = str(uuid.uuid4())  # as torchrun --standalone does
    fields: dict[str, object] = {
        "entrypoint": args.training_script,
        "script_args": tuple(args.training_script_args),
        "module": args.module,
        "no_python": args.no_python,
        "nnodes_min": nnodes_min,
        "nnodes_max": nnodes_max,
        "nproc_per_node": _nproc(args.nproc_per_node),
        "max_restarts": args.max_restarts,
        "standalone": args.standalone,
        "rdzv_backend": args.rdzv_backend,
        "rdzv_endpoint": args.rdzv_endpoint,
        "run_id": run_id,
        "rdzv_conf": rdzv_conf,
        "master_addr": args.master_addr,
        "master_port": args.master_port,
        "local_addr": args.local_addr,
        "node_keepalive_timeout_s": args.node_keepalive_timeout,
        "role": args.role,
        "start_method": args.start_method,
        "preload": tuple(m.strip() for m in args.preload.split(",") if m.strip()),
        "log_dir": args.log_dir,
        "redirects": args.redirects,
        "tee": args.tee,
        "local_ranks_filter": ranks_filter,
        "shutdown_timeout_s": args.shutdown_timeout,
        "enable_fault_injection": args.enable_fault_injection,
        "api_host": args.api_host,
        "api_port": None if args.api_port == "off" else args.api_port,
        "api_token_file": args.api_token_file,
        "termination_signal": args.termination_signal,
        "restart_mode": args.restart_mode,
        **_restart_backoff(args.restart_backoff),
        "inprocess_respawn": args.inprocess_respawn,
    }
    if args.node_id:
        fields["node_id"] = args.node_id
    last_call = args.rdzv_last_call_timeout or rdzv_conf.get("last_call_timeout")
    if last_call is not None:
        fields["rdzv_last_call_timeout_s"] = last_call
    join = args.rdzv_join_timeout or rdzv_conf.get("join_timeout")
    if join is not None:
        fields["rdzv_join_timeout_s"] = join
    fields.update(_fault_tolerance_fields(args))
    try:
        return ServeConfig.model_validate(fields)
    except ValidationError as error:
        raise UsageError(format_validation_error(error)) from None


def _restart_backoff(value: str) -> dict[str, object]:
    """`--restart-backoff BASE:CAP[:RESET]` (seconds) as ServeConfig fields."""
    parts = value.split(":")
    if not 1 <= len(parts) <= 3:
        raise UsageError(f"--restart-backoff: expected BASE:CAP[:RESET] seconds, got {value!r}")
    names = ("restart_backoff_base_s", "restart_backoff_cap_s", "restart_backoff_reset_s")
    try:
        return {name: float(part) for name, part in zip(names, parts, strict=False) if part}
    except ValueError:
        raise UsageError(f"--restart-backoff: not seconds: {value!r}") from None


def _fault_tolerance_fields(args: argparse.Namespace) -> dict[str, object]:
    """ServeConfig fields from --ft-cfg-path and the --ft-* flags (CLI over file)."""
    from pathlib import Path

    from ftd.ft_config import load_yaml, merge_parameters

    from_file: dict[str, object] = {}
    if args.ft_cfg_path:
        try:
            from_file = load_yaml(Path(args.ft_cfg_path))
        except (OSError, ValueError) as error:
            raise UsageError(f"--ft-cfg-path: {error}") from None
    from_cli = {
        key.removeprefix("ft__"): value
        for key, value in vars(args).items()
        if key.startswith("ft__") and value is not None
    }
    try:
        ft, delegated, ignored = merge_parameters(from_file, from_cli)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if ignored:
        logging.getLogger("ftd.config").info(
            "fault-tolerance parameters with no effect in ftd: %s", ", ".join(sorted(ignored))
        )
    fields: dict[str, object] = {"ft": ft}
    policy = args.restart_policy or delegated.get("restart_policy")
    if policy:
        fields["restart_policy"] = policy
    state_file = args.ft_state_file or delegated.get("ft_state_file")
    if state_file:
        fields["ft_state_file"] = state_file
    return fields


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="[ftd %(levelname).1s %(asctime)s %(name)s] %(message)s",
        stream=sys.stderr,
    )


def _run_serve(args: argparse.Namespace) -> int:
    try:
        config = serve_config_from_args(args)
        if args.log_level.upper() not in logging.getLevelNamesMapping():
            raise UsageError(f"--log-level: unknown level {args.log_level!r}")
    except UsageError as error:
        print(f"ftd serve: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    _configure_logging(args.log_level)
    import uvloop

    from ftd.config import ServeConfig
    from ftd.daemon import Daemon

    assert isinstance(config, ServeConfig)

    async def serve() -> int:
        async with Daemon(config) as daemon:
            return await daemon.run()

    from ftd.api import ApiStartupError
    from ftd.errors import StartupError

    try:
        return uvloop.run(serve())
    except (ApiStartupError, StartupError) as error:  # raised before any rank started
        print(f"ftd serve: error: {error}", file=sys.stderr)
        return EXIT_USAGE


def _run_store(host: str, port: int) -> int:
    """`ftd store`: a TCPStore server until SIGINT/SIGTERM."""
    import signal
    import threading

    from ftd_client.store import tcp_store_server

    _configure_logging("INFO")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        store = tcp_store_server(host, port)
    except Exception as error:
        print(f"ftd store: error: cannot listen on {host}:{port}: {error}", file=sys.stderr)
        return 1
    logging.getLogger("ftd.store").info("rendezvous store listening on %s:%d", host, store.port)
    stop.wait()
    del store
    return 0


def _unknown_ft_parameter(unknown: list[str]) -> str | None:
    """A one-line error naming the closest valid name for a mistyped --ft-* flag."""
    from ftd.ft_config import UnknownParameter, check_parameter_name

    for token in unknown:
        if token.startswith("--ft-"):
            name = token.split("=", 1)[0].removeprefix("--ft-").removeprefix("param-")
            try:
                check_parameter_name(name)
            except UnknownParameter as error:
                return str(error)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    from ftd.admin_cli import COMMANDS, admin_main

    words = list(sys.argv[1:] if argv is None else argv)
    if words and words[0] in COMMANDS:  # operators' commands: no torch, no pydantic
        return admin_main(words)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and (message := _unknown_ft_parameter(unknown)):
        print(f"ftd {args.command}: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    if unknown:
        print(
            f"ftd {args.command}: error: unrecognized arguments: {' '.join(unknown)}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.command == "serve":
        return _run_serve(args)
    if args.command == "store":
        return _run_store(args.host, args.port)
    parser.error(f"unknown command {args.command!r}")
