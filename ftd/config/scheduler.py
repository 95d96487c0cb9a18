"""What the scheduler already knows: `ftd serve` flags filled from Slurm, Kubernetes and torchrun's
`PET_*` environment, so `ftd serve train.py` needs no rendezvous flags inside a job.

Precedence, highest first: an explicit flag (the CLI applies it), torchrun's `PET_<FLAG>`
variables (set by Kubeflow's PyTorchJob and TrainJob, read by torchrun itself), then the
scheduler's own variables (Slurm's `SLURM_*`; in a Kubernetes pod, PyTorchJob's `MASTER_ADDR`,
`MASTER_PORT`, `WORLD_SIZE`, `RANK` and an Indexed Job's `JOB_COMPLETION_INDEX`), then the
flag's default. Every value is parsed with bounds; a bad one is a `SchedulerError` naming the
variable (the CLI prints it on one line and exits 2).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from ftd.text import is_decimal

DEFAULT_RDZV_PORT = 29400
"""torchrun's port when `--rdzv-endpoint` names no port."""
MAX_NODES = 100_000
MAX_NPROC = 4096
MAX_RESTARTS = 1_000_000
MAX_HOSTS = 1 << 20
"""A node list expanding to more hosts than this is refused (`n[0-999999999]`)."""
MAX_VALUE_CHARS = 4096
MAX_GROUPS = 16
"""Bracket groups in one host name (`rack[1-4]-node[01-32]` has 2); Slurm's own names have a
few, and a name with more is refused before anything is expanded."""

_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}")
_HOST = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,252})")
_BRACKETS = re.compile(r"\[([^\[\]]*)\]")


class SchedulerError(ValueError):
    """An environment variable the scheduler set (or someone else did) cannot be used."""


@dataclass(frozen=True)
class Setting:
    """One `ftd serve` option's value (in the form argparse gives it) and where it came from."""

    value: object
    source: str
    """The environment variable(s), e.g. `SLURM_NNODES` or `MASTER_ADDR+MASTER_PORT`."""


@dataclass(frozen=True)
class Detected:
    scheduler: str
    """`slurm`, `kubernetes`, `torchrun` (PET_* only) or `none`."""
    settings: dict[str, Setting] = field(default_factory=dict)
    """By the serve parser's dest: nnodes, nproc_per_node, node_rank, rdzv_endpoint, rdzv_id,
    rdzv_backend, rdzv_conf, max_restarts, standalone."""


def _shown(text: str, limit: int = 80) -> str:
    """A value quoted in an error: repr (no control character reaches the terminal), cut."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} chars)"


# -- Slurm host lists -------------------------------------------------------------------------


def expand_hostlist(text: str, limit: int = MAX_HOSTS) -> list[str]:
    """Slurm's compressed host list, expanded in order as `scontrol show hostnames` does:
    `node[01-03,07],gpu-[1-2]` -> node01 node02 node03 node07 gpu-1 gpu-2. Zero padding follows
    the range's first bound; several bracket groups in one name expand as a product, the first
    group outermost; duplicates are kept. ValueError for malformed lists or more than `limit`."""
    return list(_iter_hostlist(text, limit))


def first_host(text: str) -> str:
    """The first host of a compressed host list, without expanding the rest."""
    for host in _iter_hostlist(text, MAX_HOSTS):
        return host
    raise ValueError("the host list is empty")


def _iter_hostlist(text: str, limit: int) -> Iterator[str]:
    if len(text) > MAX_VALUE_CHARS * 16:
        raise ValueError(f"the host list is longer than {MAX_VALUE_CHARS * 16} characters")
    count = 0
    for item in _split_top_level(text):
        outside = _BRACKETS.sub("", item)
        if "[" in outside or "]" in outside:
            raise ValueError(f"nested brackets in {_shown(item)}")
        total = 1
        found = _BRACKETS.findall(item)
        if len(found) > MAX_GROUPS:
            raise ValueError(f"more than {MAX_GROUPS} bracket groups in one host name")
        groups = [_parse_ranges(group, item) for group in found]
        for ranges in groups:
            total *= sum(high - low + 1 for low, high, _ in ranges)
        if count + total > limit:
            raise ValueError(f"the host list names more than {limit} hosts")
        count += total
        for host in _expand(_BRACKETS.split(item), groups):
            if not _HOST.fullmatch(host):
                raise ValueError(f"{_shown(host)} is not a host name")
            yield host


def _split_top_level(text: str) -> list[str]:
    items: list[str] = []
    current: list[str] = []
    depth = 0
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced brackets in {_shown(text)}")
        if char == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise ValueError(f"unbalanced brackets in {_shown(text)}")
    items.append("".join(current))
    stripped = [item.strip() for item in items]
    if any(not item for item in stripped) and any(stripped):
        raise ValueError(f"an empty host name in {_shown(text)}")
    return [item for item in stripped if item]


def _parse_ranges(group: str, item: str) -> list[tuple[int, int, int]]:
    """`01-03,7` -> [(1, 3, 2), (7, 7, 1)]: (low, high, zero-padded width)."""
    ranges = []
    for part in group.split(","):
        low_text, sep, high_text = part.strip().partition("-")
        if not is_decimal(low_text) or (sep and not is_decimal(high_text)) or len(low_text) > 18:
            raise ValueError(f"bad range {_shown(part)} in {_shown(item)}")
        if len(high_text) > 18:
            raise ValueError(f"bad range {_shown(part)} in {_shown(item)}")
        low = int(low_text)
        high = int(high_text) if sep else low
        if high < low:
            raise ValueError(f"range {_shown(part)} in {_shown(item)} goes backwards")
        ranges.append((low, high, len(low_text)))
    return ranges


def _expand(pieces: list[str], groups: list[list[tuple[int, int, int]]]) -> Iterator[str]:
    """pieces alternate text and bracket contents (re.split with a group); groups are the
    parsed bracket contents in order. An odometer over the groups, the last one fastest: no
    recursion, whatever the number of groups."""
    texts = pieces[0::2]
    numbers = [
        [f"{n:0{width}d}" for low, high, width in ranges for n in range(low, high + 1)]
        if sum(high - low + 1 for low, high, _ in ranges) <= 4096
        else None
        for ranges in groups
    ]
    counts = [sum(high - low + 1 for low, high, _ in ranges) for ranges in groups]
    if any(count == 0 for count in counts):
        return
    digits = [0] * len(groups)
    while True:
        parts = [texts[0]]
        for index, ranges in enumerate(groups):
            shown = numbers[index]
            parts.append(shown[digits[index]] if shown is not None else _nth(ranges, digits[index]))
            parts.append(texts[index + 1])
        yield "".join(parts)
        position = len(groups) - 1
        while position >= 0:
            digits[position] += 1
            if digits[position] < counts[position]:
                break
            digits[position] = 0
            position -= 1
        if position < 0:
            return


def _nth(ranges: list[tuple[int, int, int]], index: int) -> str:
    """The index-th number of a bracket group (for groups too long to list up front)."""
    for low, high, width in ranges:
        if index <= high - low:
            return f"{low + index:0{width}d}"
        index -= high - low + 1
    raise IndexError(index)


# -- parsing one variable ---------------------------------------------------------------------


def _text(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name)
    if raw is None:
        return None
    value = raw.strip()
    if len(value) > MAX_VALUE_CHARS:
        raise SchedulerError(f"{name}: longer than {MAX_VALUE_CHARS} characters")
    if any(ord(char) < 32 for char in value):
        raise SchedulerError(f"{name}: contains control characters")
    return value


def _int(name: str, value: str, low: int, high: int) -> int:
    if not is_decimal(value) or len(value) > 12:
        raise SchedulerError(f"{name}: expected an integer, got {_shown(value)}")
    number = int(value)
    if not low <= number <= high:
        raise SchedulerError(f"{name}: must be between {low} and {high}, got {number}")
    return number


def _nnodes(name: str, value: str) -> str:
    low, sep, high = value.partition(":")
    minimum = _int(name, low, 1, MAX_NODES)
    maximum = _int(name, high, 1, MAX_NODES) if sep else minimum
    if minimum > maximum:
        raise SchedulerError(f"{name}: MIN {minimum} is above MAX {maximum}")
    return f"{minimum}:{maximum}" if sep else str(minimum)


def _nproc(name: str, value: str) -> str:
    if value in ("auto", "cpu"):
        return value
    return str(_int(name, value, 1, MAX_NPROC))


def _job_id(name: str, value: str) -> str:
    if not _JOB_ID.fullmatch(value):
        raise SchedulerError(
            f"{name}: not a job id (letters, digits, _.+-; 1-128), got {_shown(value)}"
        )
    return value


def _host(name: str, value: str) -> str:
    host = value.removeprefix("[").removesuffix("]")
    if not (_HOST.fullmatch(host) or re.fullmatch(r"[0-9A-Fa-f:.]{2,45}", host)):
        raise SchedulerError(f"{name}: not a host name or address, got {_shown(value)}")
    return f"[{host}]" if ":" in host else host


def _endpoint(name: str, value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or (host.count(":") and not host.startswith("[")):
        return f"{_host(name, value)}:{DEFAULT_RDZV_PORT}"
    return f"{_host(name, host)}:{_int(name, port, 1, 65535)}"


def _flag_bool(name: str, value: str) -> bool:
    if value.lower() in ("", "1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no"):
        return False
    raise SchedulerError(f"{name}: expected 1/true or 0/false, got {_shown(value)}")


def _rdzv_conf(name: str, value: str) -> str:
    for item in filter(None, value.split(",")):
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise SchedulerError(f"{name}: expected key=value,..., got {_shown(item)}")
    return value


def _backend(name: str, value: str) -> str:
    if not re.fullmatch(r"[a-z0-9_-]{1,32}", value):
        raise SchedulerError(f"{name}: not a rendezvous backend name, got {_shown(value)}")
    return value


# -- the sources ------------------------------------------------------------------------------

Parser = Callable[[str, str], object]

PET_VARIABLES: list[tuple[str, str, Parser]] = [
    ("nnodes", "PET_NNODES", _nnodes),
    ("nproc_per_node", "PET_NPROC_PER_NODE", _nproc),
    ("nproc_per_node", "PET_N_PROC_PER_NODE", _nproc),  # older training operators
    ("node_rank", "PET_NODE_RANK", lambda n, v: _int(n, v, 0, MAX_NODES - 1)),
    ("rdzv_endpoint", "PET_RDZV_ENDPOINT", _endpoint),
    ("rdzv_id", "PET_RDZV_ID", _job_id),
    ("rdzv_backend", "PET_RDZV_BACKEND", _backend),
    ("rdzv_conf", "PET_RDZV_CONF", _rdzv_conf),
    ("max_restarts", "PET_MAX_RESTARTS", lambda n, v: _int(n, v, 0, MAX_RESTARTS)),
    ("standalone", "PET_STANDALONE", _flag_bool),
]
"""torchrun reads `PET_<DEST>` as the default of each of its flags; so does ftd for these."""


def _pet(env: Mapping[str, str], settings: dict[str, Setting]) -> None:
    for dest, name, parse in PET_VARIABLES:
        value = _text(env, name)
        if value is not None and dest not in settings:
            settings[dest] = Setting(parse(name, value), name)
    _endpoint_from(env, "PET_MASTER_ADDR", "PET_MASTER_PORT", settings)


def _endpoint_from(
    env: Mapping[str, str], addr_name: str, port_name: str, settings: dict[str, Setting]
) -> None:
    """torchrun's static rendezvous meets at MASTER_ADDR:MASTER_PORT: ftd's rendezvous store
    goes there (the workers' store is the daemons' business)."""
    addr, port = _text(env, addr_name), _text(env, port_name)
    if addr is None or "rdzv_endpoint" in settings:
        return
    host = _host(addr_name, addr)
    if port is None:
        settings["rdzv_endpoint"] = Setting(f"{host}:{DEFAULT_RDZV_PORT}", addr_name)
    else:
        number = _int(port_name, port, 1, 65535)
        settings["rdzv_endpoint"] = Setting(f"{host}:{number}", f"{addr_name}+{port_name}")


def _slurm(env: Mapping[str, str], settings: dict[str, Setting]) -> None:
    def fill(dest: str, name: str, parse: Parser) -> None:
        value = _text(env, name)
        if value is not None and value != "" and dest not in settings:
            settings[dest] = Setting(parse(name, value), name)

    fill("rdzv_id", "SLURM_JOB_ID", _job_id)
    fill("nnodes", "SLURM_NNODES", _nnodes)
    fill("nnodes", "SLURM_JOB_NUM_NODES", _nnodes)
    gpus = _text(env, "SLURM_GPUS_ON_NODE")
    if gpus and _int("SLURM_GPUS_ON_NODE", gpus, 0, MAX_NPROC) > 0:
        fill("nproc_per_node", "SLURM_GPUS_ON_NODE", _nproc)
    fill("nproc_per_node", "SLURM_NTASKS_PER_NODE", _nproc)
    # Inside an srun step, node ids count from the step's first node.
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        nodelist = _text(env, name)
        if nodelist and "rdzv_endpoint" not in settings:
            try:
                host = first_host(nodelist)
            except ValueError as error:
                raise SchedulerError(f"{name}: {error}") from None
            settings["rdzv_endpoint"] = Setting(f"{host}:{DEFAULT_RDZV_PORT}", name)
    fill("node_rank", "SLURM_NODEID", lambda n, v: _int(n, v, 0, MAX_NODES - 1))


def _kubernetes(env: Mapping[str, str], settings: dict[str, Setting]) -> None:
    """A PyTorchJob's pods without an elastic policy get MASTER_ADDR/PORT, WORLD_SIZE (pods)
    and RANK (this pod); an Indexed Job's (JobSet's) pods get JOB_COMPLETION_INDEX."""
    _endpoint_from(env, "MASTER_ADDR", "MASTER_PORT", settings)
    world = _text(env, "WORLD_SIZE")
    if world and "nnodes" not in settings:
        settings["nnodes"] = Setting(_nnodes("WORLD_SIZE", world), "WORLD_SIZE")
    for name in ("RANK", "JOB_COMPLETION_INDEX"):
        value = _text(env, name)
        if value and "node_rank" not in settings:
            settings["node_rank"] = Setting(_int(name, value, 0, MAX_NODES - 1), name)


def detect(env: Mapping[str, str]) -> Detected:
    """The serve options the environment sets; SchedulerError naming a bad variable."""
    settings: dict[str, Setting] = {}
    _pet(env, settings)
    scheduler = "torchrun" if settings else "none"
    if _text(env, "SLURM_JOB_ID"):
        scheduler = "slurm"
        _slurm(env, settings)
    elif _text(env, "KUBERNETES_SERVICE_HOST"):
        scheduler = "kubernetes"
        _kubernetes(env, settings)
    _check_node_rank(settings)
    return Detected(scheduler, settings)


def _check_node_rank(settings: dict[str, Setting]) -> None:
    rank, nnodes = settings.get("node_rank"), settings.get("nnodes")
    if rank is None or nnodes is None:
        return
    maximum = int(str(nnodes.value).rpartition(":")[2])
    assert isinstance(rank.value, int)
    if rank.value >= maximum:
        raise SchedulerError(
            f"{rank.source}: node rank {rank.value} is not below the {maximum} nodes of "
            f"{nnodes.source}"
        )
