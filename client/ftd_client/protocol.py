"""The wire format between ranks and their node daemon; both sides import it.

This module defines the protocol: its transport, kinds, fields and bounds. Each kind is a
record (messages.py, checkpoint_messages.py), and wire.py is the one door between records and
packets: the rank encodes records, the daemon decodes packets into them.

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
import signal

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

MAX_SLOTS = 64
"""A rank's slots in the node's memory: 2 or 3, more while snapshots are kept for the replicas
on a peer node (ftd/checkpoint/ledger.py)."""
MAX_EVERY = 2**20
"""The longest interval between a rank's snapshots, in steps (checkpoint/_spacing.py)."""
MAX_DESCRIPTION = 1000
"""A workload request's description (the daemon keeps this much)."""
MAX_FAULT_KIND = 16
UNREGISTRABLE_SIGNALS = frozenset({signal.SIGKILL, signal.SIGSTOP})

# Pre-encoded: a heartbeat is a constant packet and a sequence number, so sending one costs
# one %-format and one syscall.
HEARTBEAT_BYTES = b'{"v":1,"t":"hb"}'
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


def valid_stack_signal(value: object) -> int | None:
    """A signal number a rank may ask to be sent for its stack dump, else None: a real,
    catchable signal (never SIGKILL or SIGSTOP, never a huge or negative integer)."""
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    try:
        sig = signal.Signals(value)
    except ValueError:
        return None
    if sig in UNREGISTRABLE_SIGNALS or sig not in signal.valid_signals():
        return None
    return int(sig)
