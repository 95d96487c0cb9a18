"""What `ftd serve` tells an operator about a configuration that parses but may not do what
they think: who hosts the rendezvous store, whether the daemons' records are signed, a run id
nobody chose, a loopback endpoint that other machines cannot reach. `--print-config` shows
each as a `#` line; the daemon logs the last two at start."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from ftd.config.serve import ServeConfig
from ftd.coordination import ETCD_BACKENDS, STORE_BACKENDS, CoordinationError
from ftd.coordination.endpoint import is_local, parse_endpoint
from ftd.coordination.secret import SECRET_ENV, SECRET_FILE_CONF, SecretError, load_secret

log = logging.getLogger("ftd.config")

_YES = ("1", "true", "yes")


@dataclass(frozen=True)
class Note:
    """One thing to tell, and how loud: `--print-config` calls a WARNING one a warning and the
    others notes; the daemon logs it at this level at start."""

    text: str
    level: int


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: an address no other machine reaches."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def store_host(config: ServeConfig) -> str:
    """Who hosts the rendezvous store, as the c10d coordinator will decide it at start."""
    if not config.multi_node:
        return "none: one node, no rendezvous (only the workers' store, hosted by this daemon)"
    if config.rdzv_backend in ETCD_BACKENDS:
        return "no daemon: the etcd cluster at --rdzv-endpoint keeps the records"
    if config.rdzv_backend not in STORE_BACKENDS:
        return f"unknown: --rdzv-backend {config.rdzv_backend!r} is not a backend"
    try:
        host, port = parse_endpoint(config.rdzv_endpoint)
    except CoordinationError as error:
        return f"unknown: {error}"
    shown = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    is_host = config.rdzv_conf.get("is_host", "").lower()
    if is_host in _YES:
        return f"this node, on {shown} (--rdzv-conf is_host={is_host})"
    if is_host:
        return f"another node or `ftd store` at {shown} (--rdzv-conf is_host={is_host})"
    if is_local(host, config.local_addr or ""):
        return (
            f"this node, on {shown}: the endpoint's host is this machine (unless another "
            "process listens there first: then this node connects to it)"
        )
    return f"another node or `ftd store` at {shown}: the endpoint's host is not this machine"


def signing(config: ServeConfig, environ: Mapping[str, str]) -> str:
    """Whether the daemons' records in the store are signed, and with what."""
    if not config.multi_node:
        return "not needed: one node, no rendezvous records"
    try:
        secret = load_secret(config.rdzv_conf, dict(environ))  # a copy: nothing popped here
    except SecretError as error:
        return f"no, and the daemon will not start: {error}"
    if secret is None:
        return (
            f"no: no job secret ({SECRET_ENV} or --rdzv-conf {SECRET_FILE_CONF}=PATH), so "
            "anyone who reaches the store can end or redirect this job (docs/security.md)"
        )
    if config.rdzv_conf.get(SECRET_FILE_CONF, "").strip():
        return f"yes, with the secret in {config.rdzv_conf[SECRET_FILE_CONF].strip()}"
    return f"yes, with the secret in {SECRET_ENV}"


def unnamed_run(config: ServeConfig, sources: Mapping[str, str]) -> Note | None:
    """The run id `none` that nobody chose (torchrun's default)."""
    if config.run_id != "none" or "rdzv_id" in sources:
        return None
    text = (
        "the run id is `none`: neither --rdzv-id nor the scheduler (PET_RDZV_ID, SLURM_JOB_ID) "
        "named this job"
    )
    if config.multi_node:
        text += ", so jobs that share a store all use `none` and join each other's rounds: give "
        text += "each job its own --rdzv-id"
        return Note(text, logging.WARNING)
    return Note(text + "; its files go to a run directory named `none`", logging.INFO)


def unreachable_endpoint(config: ServeConfig) -> Note | None:
    """Several nodes told to meet at a loopback address. Silent when --local-addr is loopback
    too: then every node is on this machine (as in ftd's own tests)."""
    if not config.multi_node or config.rdzv_backend not in STORE_BACKENDS:
        return None  # etcd: a loopback member can be each machine's own etcd gateway
    if config.local_addr and is_loopback(config.local_addr):
        return None
    named: list[str] = []
    try:
        host, port = parse_endpoint(config.rdzv_endpoint)
    except CoordinationError:
        return None  # the coordinator says why at start
    if is_loopback(host):
        given = f"--rdzv-endpoint {config.rdzv_endpoint}" if config.rdzv_endpoint else None
        named.append(given or f"the default --rdzv-endpoint {host}:{port}")
    if config.master_addr and is_loopback(config.master_addr):
        named.append(f"--master-addr {config.master_addr}")
    if not named:
        return None
    return Note(
        f"{' and '.join(named)} is a loopback address: with --nnodes {_nnodes(config)} the "
        "other machines' daemons cannot reach it and this node waits for them in vain. Give an "
        "address they reach (--rdzv-endpoint HOST:PORT of the hosting node), or --local-addr "
        "127.0.0.1 when every node runs on this machine",
        logging.WARNING,
    )


def hot_spares(config: ServeConfig) -> Note | None:
    """--hot-spares: say the reading of --nnodes it chose."""
    if not config.hot_spares:
        return None
    return Note(
        f"--hot-spares: {config.nnodes_max} nodes run the job; up to {config.hot_spares} more "
        "wait as standbys and take a lost node's place (NVRx's reading of --nnodes MIN:MAX)",
        logging.INFO,
    )


def _nnodes(config: ServeConfig) -> str:
    low, high = config.nnodes_min, config.nnodes_max
    return str(high) if low == high else f"{low}:{high}"


def print_config_notes(
    config: ServeConfig, sources: Mapping[str, str], environ: Mapping[str, str]
) -> list[str]:
    """The `#` lines `--print-config` adds to its header."""
    lines = [
        f"# rendezvous store hosted by: {store_host(config)}",
        f"# records signed: {signing(config, environ)}",
    ]
    for note in (unnamed_run(config, sources), unreachable_endpoint(config), hot_spares(config)):
        if note is not None:
            lines.append(f"# {'warning' if note.level == logging.WARNING else 'note'}: {note.text}")
    return lines


def log_start_notes(config: ServeConfig, sources: Mapping[str, str]) -> None:
    """What the daemon says before it starts anything (once, like --print-config's notes)."""
    for note in (unnamed_run(config, sources), unreachable_endpoint(config), hot_spares(config)):
        if note is not None:
            log.log(note.level, "%s", note.text)
