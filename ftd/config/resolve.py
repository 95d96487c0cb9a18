"""From `ftd serve`'s command line and environment to the one ServeConfig, and where each of its
values came from (`--print-config`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from ftd.config.scheduler import Detected, SchedulerError, detect
from ftd.config.serve import DEFAULT_API_PORT, ServeConfig, parse_nnodes, parse_rdzv_conf
from ftd.errors import format_validation_error
from ftd.text import is_decimal

MAX_LIST = 100_000


class UsageError(Exception):
    """Bad input on the command line or in the environment: one line on stderr and exit
    code 2, nothing started."""


FLAG = "flag"
DEFAULT = "default"


def apply_scheduler(
    args: argparse.Namespace, explicit: set[str], env: Mapping[str, str]
) -> tuple[Detected, dict[str, str]]:
    """Fill the options the command line left unset from the scheduler's environment; the
    detection and each option's source (`flag`, a variable's name, or `default`)."""
    try:
        detected = detect(env)
    except SchedulerError as error:
        raise UsageError(str(error)) from None
    except (ValueError, RecursionError, MemoryError) as error:  # a decoder's bug: still one line
        raise UsageError(f"the scheduler's environment cannot be used: {error!r:.200}") from None
    sources = {dest: FLAG for dest in explicit}
    for dest, setting in detected.settings.items():
        if dest not in explicit:
            setattr(args, dest, setting.value)
            sources[dest] = setting.source
    return detected, sources


def _nproc(value: str) -> int:
    if value in ("cpu", "auto"):
        return os.cpu_count() or 1
    try:
        return int(value)
    except ValueError:
        raise UsageError(
            f"--nproc-per-node: expected an integer or cpu/auto, got {value!r}"
        ) from None


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig for `ftd serve` arguments; UsageError naming the field when invalid."""
    from pydantic import ValidationError

    try:
        nnodes_min, nnodes_max = parse_nnodes(args.nnodes)
        hot_spares = nnodes_max - nnodes_min if args.hot_spares else 0
        nnodes_max -= hot_spares
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
    converted: dict[str, object] = {
        "script_args": tuple(args.training_script_args),
        "nnodes_min": nnodes_min,
        "nnodes_max": nnodes_max,
        "hot_spares": hot_spares,
        "nproc_per_node": _nproc(args.nproc_per_node),
        "run_id": run_id,
        "rdzv_conf": rdzv_conf,
        "preload": tuple(m.strip() for m in args.preload.split(",") if m.strip()),
        "local_ranks_filter": ranks_filter,
        "api_port": None if args.api_port == "off" else args.api_port or DEFAULT_API_PORT,
        "api_port_explicit": args.api_port is not None,
        "progress": args.progress == "on",
        "checkpoint_memory_bytes": None
        if args.checkpoint_memory == "auto"
        else args.checkpoint_memory,
        "checkpoint_every": None if args.checkpoint_every == "auto" else args.checkpoint_every,
        **_persist(args),
        **_restart_backoff(args.restart_backoff),
    }
    fields = {**_as_given(args), **converted}
    last_call = args.rdzv_last_call_timeout or rdzv_conf.get("last_call_timeout")
    if last_call is not None:
        fields["rdzv_last_call_timeout_s"] = last_call
    join = args.rdzv_join_timeout or rdzv_conf.get("join_timeout")
    if join is not None:
        fields["rdzv_join_timeout_s"] = join
    if (listed := rdzv_conf.get("list_max")) is not None:
        if not is_decimal(listed) or len(listed) > 6 or int(listed) > MAX_LIST:
            raise UsageError(
                f"--rdzv-conf list_max={listed[:40]}: a number of nodes, 0 to {MAX_LIST}"
            )
        fields["rdzv_list_max"] = int(listed)
    fields.update(_fault_tolerance_fields(args))
    try:
        return ServeConfig.model_validate(fields)
    except ValidationError as error:
        raise UsageError(format_validation_error(error)) from None


def _persist(args: argparse.Namespace) -> dict[str, object]:
    if args.checkpoint_persist is None:
        if args.checkpoint_persist_every is not None:
            raise UsageError("--checkpoint-persist-every needs --checkpoint-persist DIR")
        return {}
    every = args.checkpoint_persist_every
    return {
        "checkpoint_persist_dir": Path(args.checkpoint_persist).absolute(),
        "checkpoint_persist_every": every or 100,
    }


def _load_ft_file(args: argparse.Namespace) -> dict[str, object]:
    from ftd.config.ft import load_yaml

    if not args.ft_cfg_path:
        return {}
    try:
        return load_yaml(Path(args.ft_cfg_path))
    except (OSError, ValueError) as error:
        raise UsageError(f"--ft-cfg-path: {error}") from None


def _cli_ft_parameters(args: argparse.Namespace) -> dict[str, object]:
    return {
        key.removeprefix("ft__"): value
        for key, value in vars(args).items()
        if key.startswith("ft__") and value is not None
    }


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
    from ftd.config.ft import merge_parameters

    try:
        ft, delegated, ignored = merge_parameters(_load_ft_file(args), _cli_ft_parameters(args))
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


# -- --print-config ---------------------------------------------------------------------------


def _as_given(args: argparse.Namespace) -> dict[str, object]:
    """The ServeConfig fields whose option's value is the field's as it was given (field_dest);
    an option left unset (None) leaves the field's default. So a plain new flag needs no line
    here: its ServeConfig field and its option, of the same name (or the name and a unit)."""
    given = vars(args)
    fields: dict[str, object] = {}
    for name in ServeConfig.model_fields:
        dest = field_dest(name, given)
        if dest is not None and given[dest] is not None:
            fields[name] = given[dest]
    return fields


UNIT_SUFFIXES = ("_s", "_bytes")
"""What ServeConfig appends to a flag's name to carry its unit (`--shutdown-timeout` ->
`shutdown_timeout_s`)."""


def field_dest(field: str, dests: Mapping[str, object]) -> str | None:
    """The option destination that sets a ServeConfig field, or None (a derived field)."""
    if field in FIELD_DESTS:
        return FIELD_DESTS[field]
    if field in dests:
        return field
    for suffix in UNIT_SUFFIXES:
        if field.endswith(suffix) and field.removesuffix(suffix) in dests:
            return field.removesuffix(suffix)
    return None


FIELD_DESTS = {
    "entrypoint": "training_script",
    "script_args": "training_script_args",
    "nnodes_min": "nnodes",
    "nnodes_max": "nnodes",
    "run_id": "rdzv_id",
    "node_keepalive_timeout_s": "node_keepalive_timeout",
    "rdzv_last_call_timeout_s": "rdzv_last_call_timeout",
    "rdzv_join_timeout_s": "rdzv_join_timeout",
    "shutdown_timeout_s": "shutdown_timeout",
}
"""ServeConfig fields whose serve option has another name (the others share it)."""


def config_sources(
    config: ServeConfig, args: argparse.Namespace, sources: dict[str, str]
) -> list[tuple[str, object, str]]:
    """(field, value, source) for every field of the config, ft's fields as `ft.NAME`."""
    rows: list[tuple[str, object, str]] = []
    dumped = config.model_dump(mode="json")
    for name, value in dumped.items():
        if name == "ft":
            continue
        dest = FIELD_DESTS.get(name, name)
        source = sources.get(dest, DEFAULT)
        if name in ("entrypoint", "script_args"):
            source = FLAG
        elif name in ("rdzv_last_call_timeout_s", "rdzv_join_timeout_s") and source == DEFAULT:
            key = name.removeprefix("rdzv_").removesuffix("_s")
            source = "--rdzv-conf" if key in config.rdzv_conf else DEFAULT
        elif name == "run_id" and args.standalone and args.rdzv_id == "none":
            source = "default (a new UUID under --standalone, as torchrun)"
        elif name == "log_dir" and value is None:
            value, source = "a new /tmp/ftd_* directory", DEFAULT
        elif name in ("restart_policy", "ft_state_file") and source == DEFAULT:
            source = "--ft-cfg-path" if args.ft_cfg_path and value is not None else DEFAULT
        rows.append((name, value, source))
    from_file = _load_ft_file(args)
    for name, value in dumped["ft"].items():
        if f"ft__{name}" in sources:
            source = FLAG
        elif name in from_file or name.replace("_", "-") in from_file:
            source = "--ft-cfg-path"
        else:
            source = DEFAULT
        rows.append((f"ft.{name}", value, source))
    return rows


def run_dir(config: ServeConfig) -> str:
    """Where the daemon will keep this run's files (README's "Where things go")."""
    base = str(config.log_dir) if config.log_dir else "/tmp/ftd_*"
    node = f"/{config.node_id}" if config.multi_node else ""
    return f"{base}{node}/{config.run_id}"


def format_config(
    config: ServeConfig,
    args: argparse.Namespace,
    detected: Detected,
    sources: dict[str, str],
    notes: Sequence[str] = (),
) -> str:
    """`--print-config`: one line per value, `name = value  # source`, after the header's `#`
    lines (and `notes`, more of them)."""
    rows = [
        (name, json.dumps(value, default=str), source)
        for name, value, source in config_sources(config, args, sources)
    ]
    width = max(len(name) for name, _, _ in rows)
    lines = [
        "# ftd serve: the configuration (nothing started)",
        f"# scheduler: {detected.scheduler}",
        f"# multi-node: {config.multi_node}",
        f"# run directory: {run_dir(config)}",
        *notes,
    ]
    lines += [f"{name.ljust(width)} = {value}  # {source}" for name, value, source in rows]
    return "\n".join(lines)
