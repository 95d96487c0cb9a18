"""The wire format between ranks and their node daemon; both sides import it.

Transport: an AF_UNIX SOCK_SEQPACKET socket per daemon, path in FTD_SOCKET (mode 0600); each
rank connects once. One message is one packet holding one JSON object, at most
MAX_MESSAGE_BYTES. The daemon learns the peer's pid from SO_PEERCRED (the kernel's word, not the
message's) and timestamps every message on receipt, so a message carries no rank, pid or time
of its own. A connected packet socket, unlike one datagram socket shared by every rank, is not
held to net.unix.max_dgram_qlen (10 on many hosts), so a burst of heartbeats while the daemon
is descheduled for a moment is queued, not dropped.

Every message has `"v"` (PROTOCOL_VERSION) and `"t"` (its type), and from ftd_client's
RankClient also `"s"`: the connection's sequence number (1, 2, ... counting every message the
rank tried to send, sent or dropped). Sends are non-blocking, so a burst, or a daemon that is
paused, loses messages; the sequence lets the daemon see the gap. Messages that change section
state (`ss`, `se`) carry `"o"`: the sections open on that connection *after* the change, so the
daemon's view converges with the next message that gets through; after a drop, the rank's next
message of any kind carries `"o"` too, and `"dropped"`: how many messages the rank has dropped
so far. A gap without `"o"` leaves the connection's section state unknown (untimed) until one
arrives.

| field | meaning |
|---|---|
| `s` | int, 1 .. 2^53: sequence number on this connection (optional: older clients) |
| `o` | list of section names open on this connection, oldest first (<= MAX_OPEN_SECTIONS) |
| `dropped` | int: messages the rank dropped so far on this client (with `o`, after a drop) |
| `m` | int: the rank's CLOCK_MONOTONIC in ns when it sent a section event or its state |

The daemon times a section from `m` rather than from its receipt (a backlog behind a burst
would delay the clock), but never from before the daemon last began reading without a pause
(a daemon or machine that was paused gives a grace instead: ftd/health/messages.py sent_at).

| t | fields | answered | meaning |
|---|---|---|---|
| `hello` | `stack_signal` (int or null) | yes | handshake; reply carries timeouts |
| `hb` |  | no | heartbeat |
| `ss` | `n` section name | no | section start |
| `se` | `n` section name | no | section end |
| `wc` | `a` WorkloadAction name, `d` description | yes | workload-control request |
| `calc` | `sections` (list/null), `oos` (bool), `rule`, `kind`, `gen` | yes | learn timeouts |
| `set` | `timeouts` (object), `learned` (names) | yes | apply timeouts (load_state_dict) |
| `bye` |  | no | the rank stops monitoring |
| `fault` | `kind`, `sections` (open now) | no | a simulated fault is being carried out |
| `up` |  | no | the rank is training again (`resumed()`): ends a restart's first step |
| `st` | `o`, `dropped` | no | the rank's state only, retried after a drop: no sign of life |
| `pg` | `steps`, `age_ms`, `entered`, `called`, `returned`, `fwd_us`, `host_us`, `auto` | no | - |
| `ckb` | `step`, `bytes`, `world`, `every`? | yes | begin a snapshot: `slot`, `path`; `refused` |
| `ckd` | `step`, `slot` | yes | the snapshot in `slot` is written whole |
| `ckr` | `world`, `step`? | yes | what to restore: `step` (null: none), `path`; or `steps` |
| `ckp` |  | yes | where DCP's files go in the node's memory (checkpoint.MemoryWriter): `path` |
| `cks` | `step`, `restored`? | no | `step` done without a snapshot; `restored`: loaded from disk |

`pg` is what the rank observed of its own progress without the script's help (progress.py has
each field's meaning): integers 0 .. MAX_SEQUENCE, `auto` the automatic sections open (name ->
ms open, at most MAX_OPEN_SECTIONS).

Messages that are answered carry `"id"` (int); the daemon replies on the same connection
with `{"v": 1, "t": "reply", "id": <id>, "ok": bool, "error": str?, "timeouts": {...}?,
"learned": [...]?}`. `learned` names the timeouts in force that were calculated rather than set
(`initial_rank_heartbeat_timeout`, `rank_heartbeat_timeout`, `rank_out_of_section_timeout`,
`section:<name>`). In `calc`, `rule` is `ftd` (default) or `nvrx` (NVRx's rule), `kind` `all`,
`hb` or `sections`, and `gen` the rank's n-th request of that rule and kind (ranks' requests of one
generation start from the same timeouts).

The `ck*` messages are ftd_client.checkpoint's, on a connection of their own (never a sign of
life): `refused` in a `ckb` reply is `busy` (every slot of the rank holds a snapshot that may
still be needed: the save is skipped) or `too_large` (it cannot fit `--checkpoint-memory`). In a
job of several nodes a `ckr` without `step` is answered with `agree: true` and `steps`, the
rank's complete snapshots: the ranks agree on one (checkpoint/_agree.py) and ask for it by `step`;
or with `pending: true` while the daemon, which holds nothing of the rank, fetches its snapshots
from the peers' replicas: the rank asks again. `ckb` and `ckr` replies carry the policy of
`--checkpoint-every`: `every` (an int, or `"auto"`), `mtbf_s` (the job's mean time between
failures so far) and `persist_every` (with --checkpoint-persist); `every` in a `ckb` is the
interval the rank uses, in steps (1 .. 2**20).
"""

from __future__ import annotations

import enum
import json
from typing import Any

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024
MAX_SECTION_NAME = 128
MAX_CONTAINERS = 256
"""Objects and arrays in one message: the largest real one (a `set` of every section's timeout)
has a handful; a deeply nested packet is refused before it is parsed."""
MAX_SECTIONS = 256
MAX_OPEN_SECTIONS = 64
"""Sections open at once on one connection: real code nests a handful; a state list is bounded."""
MAX_SEQUENCE = 2**53

HELLO = "hello"
HEARTBEAT = "hb"
SECTION_START = "ss"
SECTION_END = "se"
WORKLOAD_CONTROL = "wc"
CALCULATE_TIMEOUTS = "calc"
SET_TIMEOUTS = "set"
GOODBYE = "bye"
FAULT = "fault"
RESUMED = "up"
STATE = "st"
PROGRESS = "pg"
CHECKPOINT_BEGIN = "ckb"
CHECKPOINT_DONE = "ckd"
CHECKPOINT_RESTORE = "ckr"
CHECKPOINT_PLACE = "ckp"
CHECKPOINT_SEEN = "cks"
"""One way: the rank did `step` and took no snapshot of it (--checkpoint-every), or restored it
from disk (`restored`)."""
REPLY = "reply"

CHECKPOINT = frozenset(
    {CHECKPOINT_BEGIN, CHECKPOINT_DONE, CHECKPOINT_RESTORE, CHECKPOINT_PLACE, CHECKPOINT_SEEN}
)
ANSWERED = frozenset(
    {HELLO, WORKLOAD_CONTROL, CALCULATE_TIMEOUTS, SET_TIMEOUTS} | CHECKPOINT - {CHECKPOINT_SEEN}
)
TYPES = frozenset(
    {HELLO, HEARTBEAT, SECTION_START, SECTION_END, WORKLOAD_CONTROL}
    | {CALCULATE_TIMEOUTS, SET_TIMEOUTS, GOODBYE, FAULT, RESUMED, STATE, PROGRESS}
    | CHECKPOINT
)
MAX_SLOTS = 64
"""A rank's slots in the node's memory: 2 or 3, more while snapshots are kept for the replicas
on a peer node (ftd/checkpoint/ledger.py)."""
CHECKPOINT_FIELDS = {
    CHECKPOINT_BEGIN: {"step": 2**53, "bytes": 2**48, "world": 2**20},
    CHECKPOINT_DONE: {"step": 2**53, "slot": MAX_SLOTS - 1},
    CHECKPOINT_RESTORE: {"world": 2**20},
    CHECKPOINT_PLACE: {},
    CHECKPOINT_SEEN: {"step": 2**53},
}
"""Each checkpoint message's required integers and their largest value (`world` >= 1)."""
CHECKPOINT_OPTIONAL = {CHECKPOINT_BEGIN: {"every": 2**20}, CHECKPOINT_SEEN: {"restored": 1}}
"""Each checkpoint message's optional integers (>= 1) and their largest value: `every`, the
steps between the rank's snapshots (checkpoint/_spacing.py MAX_EVERY); `restored`: the rank
restored `step` from --checkpoint-persist."""
PROGRESS_COUNTS = ("steps", "age_ms", "entered", "called", "returned", "fwd_us", "host_us")
"""A progress message's integers, 0 .. MAX_SEQUENCE."""
PROGRESS_REQUIRED = frozenset({"steps", "called", "returned"})
"""The counts every progress message carries (the others only once the rank has them)."""
MAX_DESCRIPTION = 1000
"""A workload request's description (the daemon keeps this much)."""
MAX_FAULT_KIND = 16

# Pre-encoded: a heartbeat is a constant packet and a sequence number, so sending one costs
# one %-format and one syscall.
HEARTBEAT_BYTES = b'{"v":1,"t":"hb"}'
RESUMED_BYTES = b'{"v":1,"t":"up"}'
HEARTBEAT_TEMPLATE = b'{"v":1,"t":"hb","s":%d}'


class WorkloadAction(enum.Enum):
    """What a rank asks of the supervisor (ft_launcher's names)."""

    CONTINUE = "continue"
    EXCLUDE_THIS_NODE = "exclude_this_node"
    SHUTDOWN_WORKLOAD = "shutdown_workload"


class ProtocolError(ValueError):
    """A packet that is not a valid message; `cause` is a short stable label for counting."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause = cause


def encode(message: dict[str, Any]) -> bytes:
    data = json.dumps({"v": PROTOCOL_VERSION, **message}, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError("oversized", f"{len(data)} bytes > {MAX_MESSAGE_BYTES}")
    return data


def section_bytes(kind: str, name: str) -> bytes:
    return encode({"t": kind, "n": name})


def sequenced_template(message: dict[str, Any], timed: bool = False) -> bytes:
    """`message` encoded with a `%d` where its sequence number goes (`template % seq`), and
    with `timed` a second one for its send time (`template % (seq, time.monotonic_ns())`)."""
    data = encode(message)
    assert data.endswith(b"}")
    tail = b',"s":%d,"m":%d}' if timed else b',"s":%d}'
    return data[:-1].replace(b"%", b"%%") + tail


def decode(data: bytes) -> dict[str, Any]:
    """Parse and validate one packet; ProtocolError with a countable cause otherwise."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError("oversized", f"{len(data)} bytes > {MAX_MESSAGE_BYTES}")
    if data.count(b"{") + data.count(b"[") > MAX_CONTAINERS:  # messages are small and flat
        raise ProtocolError("malformed", f"more than {MAX_CONTAINERS} objects or arrays")
    try:
        message = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ProtocolError("malformed", str(error)[:200]) from None
    if not isinstance(message, dict):
        raise ProtocolError("malformed", "not a JSON object")
    if message.get("v") != PROTOCOL_VERSION:
        raise ProtocolError("unknown_version", f"version {message.get('v')!r}")
    kind = message.get("t")
    if kind not in TYPES:
        raise ProtocolError("unknown_type", f"type {kind!r}")
    if kind in (SECTION_START, SECTION_END):
        name = message.get("n")
        if not isinstance(name, str) or not name or len(name) > MAX_SECTION_NAME:
            raise ProtocolError("bad_section_name", f"section name {name!r}")
    if kind in ANSWERED and not isinstance(message.get("id"), int):
        raise ProtocolError("missing_id", f"{kind} needs an integer id")
    _check_sync_fields(message)
    if kind == WORKLOAD_CONTROL:
        try:
            WorkloadAction[str(message.get("a"))]
        except KeyError:
            raise ProtocolError("bad_action", f"action {message.get('a')!r}") from None
    if kind == PROGRESS:
        _check_progress(message)
    if kind in CHECKPOINT:
        _check_checkpoint(kind, message)
    if kind in _REQUEST_CHECKS:
        _REQUEST_CHECKS[kind](message)
    return message


def _check_workload(message: dict[str, Any]) -> None:
    description = message.get("d", "")
    if not isinstance(description, str) or len(description) > MAX_DESCRIPTION:
        raise ProtocolError("bad_request", f"description must be text of <= {MAX_DESCRIPTION}")


def _check_calculate(message: dict[str, Any]) -> None:
    sections = message.get("sections")
    if sections is not None:
        _names(sections, "sections")
    if not isinstance(message.get("oos", True), bool):
        raise ProtocolError("bad_request", "oos must be true or false")
    rule, kind = message.get("rule", "ftd"), message.get("kind", "all")
    if rule not in ("ftd", "nvrx") or kind not in ("all", "hb", "sections"):
        raise ProtocolError("bad_request", f"rule {rule!r:.20} / kind {kind!r:.20}")
    generation = message.get("gen")
    if generation is not None and not (_is_int(generation) and 0 < generation < 2**31):
        raise ProtocolError("bad_request", "gen must be a positive integer")


def _check_set(message: dict[str, Any]) -> None:
    if not isinstance(message.get("timeouts"), dict):
        raise ProtocolError("bad_request", "timeouts must be an object")
    _names(message.get("learned", []), "learned")


def _check_fault(message: dict[str, Any]) -> None:
    fault = message.get("kind")
    if not isinstance(fault, str) or not 0 < len(fault) <= MAX_FAULT_KIND:
        raise ProtocolError("bad_request", f"fault kind {fault!r:.40}")


def _names(value: object, what: str) -> None:
    if (
        not isinstance(value, list)
        or len(value) > MAX_SECTIONS
        or not all(isinstance(n, str) and 0 < len(n) <= MAX_SECTION_NAME for n in value)
    ):
        raise ProtocolError("bad_request", f"{what} must be a list of at most {MAX_SECTIONS} names")


_REQUEST_CHECKS = {
    WORKLOAD_CONTROL: _check_workload,
    CALCULATE_TIMEOUTS: _check_calculate,
    SET_TIMEOUTS: _check_set,
    FAULT: _check_fault,
}
"""What each request's consumer needs, decided here: a message that passes the decoder is one
its handler can use (no handler validates again or raises on a missing field)."""


def _check_checkpoint(kind: str, message: dict[str, Any]) -> None:
    step = message.get("step") if kind == CHECKPOINT_RESTORE else 0
    if step is not None and not (isinstance(step, int) and _is_int(step) and 0 <= step <= 2**53):
        raise ProtocolError("bad_checkpoint", f"step {step!r:.40}")
    for key, largest in CHECKPOINT_FIELDS[kind].items():
        value = message.get(key)
        smallest = 1 if key == "world" else 0
        if not (isinstance(value, int) and _is_int(value) and smallest <= value <= largest):
            raise ProtocolError("bad_checkpoint", f"{key} {value!r:.40}")
    for key, largest in CHECKPOINT_OPTIONAL.get(kind, {}).items():
        value = message.get(key)
        if value is not None and not (_is_int(value) and 1 <= value <= largest):
            raise ProtocolError("bad_checkpoint", f"{key} {value!r:.40}")


def _check_progress(message: dict[str, Any]) -> None:
    for key in PROGRESS_COUNTS:
        value = message.get(key)
        if value is None and key in PROGRESS_REQUIRED:
            raise ProtocolError("bad_progress", f"{key} is missing")
        if value is None:
            message.pop(key, None)  # a null count is one not sent: its consumers see none
        if value is not None and not (_is_int(value) and 0 <= value <= MAX_SEQUENCE):
            raise ProtocolError("bad_progress", f"{key} {value!r:.40}")
    auto = message.get("auto")
    if auto is None:
        return
    if not isinstance(auto, dict) or len(auto) > MAX_OPEN_SECTIONS:
        raise ProtocolError("bad_progress", "auto must be an object of open sections")
    for name, age in auto.items():
        if not name or len(name) > MAX_SECTION_NAME:
            raise ProtocolError("bad_section_name", f"automatic section {name!r:.40}")
        if not (_is_int(age) and 0 <= age <= MAX_SEQUENCE):
            raise ProtocolError("bad_progress", f"automatic section age {age!r:.40}")


def _check_sync_fields(message: dict[str, Any]) -> None:
    """`s`, `o`, `dropped` and `m` (see the module's docstring), when present."""
    seq = message.get("s")
    if seq is not None and not (_is_int(seq) and 0 < seq <= MAX_SEQUENCE):
        raise ProtocolError("bad_sequence", f"sequence {seq!r:.40}")
    dropped = message.get("dropped")
    if dropped is not None and not (_is_int(dropped) and 0 <= dropped <= MAX_SEQUENCE):
        raise ProtocolError("bad_sequence", f"dropped count {dropped!r:.40}")
    sent = message.get("m")
    if sent is not None and not (_is_int(sent) and 0 <= sent < 2**63):
        raise ProtocolError("bad_time", f"send time {sent!r:.40}")
    state = message.get("o")
    if state is None:
        return
    if not isinstance(state, list):
        raise ProtocolError("bad_state", "open sections must be a list")
    if len(state) > MAX_OPEN_SECTIONS:
        raise ProtocolError("budget_open_sections", f"{len(state)} open > {MAX_OPEN_SECTIONS}")
    for name in state:
        if not isinstance(name, str) or not name or len(name) > MAX_SECTION_NAME:
            raise ProtocolError("bad_section_name", f"open section {name!r:.40}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
