"""The wire format between ranks and their node daemon; both sides import it.

Transport: an AF_UNIX SOCK_SEQPACKET socket per daemon, path in FTD_SOCKET (mode 0600); each
rank connects once. One message is one packet holding one JSON object, at most
MAX_MESSAGE_BYTES. The daemon learns the peer's pid from SO_PEERCRED (the kernel's word, not the
message's) and timestamps every message on receipt, so a message carries no rank, pid or time
of its own. A connected packet socket, unlike one datagram socket shared by every rank, is not
held to net.unix.max_dgram_qlen (10 on many hosts), so a burst of heartbeats while the daemon
is descheduled for a moment is queued, not dropped.

Every message has `"v"` (PROTOCOL_VERSION) and `"t"` (its type):

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

Messages that are answered carry `"id"` (int); the daemon replies on the same connection
with `{"v": 1, "t": "reply", "id": <id>, "ok": bool, "error": str?, "timeouts": {...}?,
"learned": [...]?}`. `learned` names the timeouts in force that were calculated rather than set
(`initial_rank_heartbeat_timeout`, `rank_heartbeat_timeout`, `rank_out_of_section_timeout`,
`section:<name>`). In `calc`, `rule` is `ftd` (default) or `nvrx` (NVRx's rule), `kind` `all`,
`hb` or `sections`, and `gen` the rank's n-th request of that rule and kind (ranks' requests of one
generation start from the same timeouts).
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
REPLY = "reply"

ANSWERED = frozenset({HELLO, WORKLOAD_CONTROL, CALCULATE_TIMEOUTS, SET_TIMEOUTS})
TYPES = frozenset(
    {HELLO, HEARTBEAT, SECTION_START, SECTION_END, WORKLOAD_CONTROL}
    | {CALCULATE_TIMEOUTS, SET_TIMEOUTS, GOODBYE, FAULT, RESUMED}
)

# Pre-encoded: a heartbeat is a constant packet, so sending one costs one syscall.
HEARTBEAT_BYTES = b'{"v":1,"t":"hb"}'
RESUMED_BYTES = b'{"v":1,"t":"up"}'


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
    if kind == WORKLOAD_CONTROL:
        try:
            WorkloadAction[str(message.get("a"))]
        except KeyError:
            raise ProtocolError("bad_action", f"action {message.get('a')!r}") from None
    return message
