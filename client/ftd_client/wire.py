"""The door between a rank's records and the wire: `encode` writes one packet, `decode` reads
one into an `Envelope` (the record and what travels around it: the request id and the
connection's sequence state) or raises ProtocolError with a countable cause. Linear in the
packet's size, bounded in what it holds; nothing past it sees JSON.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ftd_client.checkpoint_messages import CheckpointMessage
from ftd_client.messages import HealthMessage, SectionEnd, SectionStart
from ftd_client.protocol import (
    MAX_CONTAINERS,
    MAX_MESSAGE_BYTES,
    MAX_OPEN_SECTIONS,
    MAX_SEQUENCE,
    PROTOCOL_VERSION,
    ProtocolError,
)
from ftd_client.wire_fields import Names, is_int, optional_integer, section_name

Message = HealthMessage | CheckpointMessage
KINDS: Mapping[str, type[Message]] = MappingProxyType(
    {kind.KIND: kind for kind in Message.__args__}
)
TYPES = frozenset(KINDS)
ANSWERED = frozenset(kind for kind, record in KINDS.items() if record.ANSWERED)
"""The kinds that carry an `id` and are answered."""


@dataclass(frozen=True, slots=True)
class Envelope:
    """One decoded packet: its message and what travels around it (protocol.py's table)."""

    message: Message
    id: int | None = None
    """A request's id (answered kinds only)."""
    seq: int | None = None
    open: Names | None = None
    """The sections open on the connection after this message (None: not said)."""
    dropped: int | None = None
    """The rank's drops so far: said after a drop, so `open` may hide a section reopened."""
    sent_ns: int | None = None


def encode(
    message: Message,
    *,
    id: int | None = None,
    seq: int | None = None,
    open: Names | list[str] | None = None,
    dropped: int | None = None,
    sent_ns: int | None = None,
) -> bytes:
    """The packet of `message` with what travels around it (None: not sent)."""
    fields: dict[str, object] = {"v": PROTOCOL_VERSION, **message.wire()}
    for key, value in (("id", id), ("s", seq), ("dropped", dropped), ("m", sent_ns)):
        if value is not None:
            fields[key] = value
    if open is not None:
        fields["o"] = list(open)
    data = json.dumps(fields, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError("oversized", f"{len(data)} bytes > {MAX_MESSAGE_BYTES}")
    return data


def section_template(message: SectionStart | SectionEnd, open: Names) -> bytes:
    """A section event with the state after it, encoded with a `%d` for its sequence number
    and one for its send time: `template % (seq, time.monotonic_ns())`."""
    data = encode(message, open=open)
    return data[:-1].replace(b"%", b"%%") + b',"s":%d,"m":%d}'


def decode(data: bytes) -> Envelope:
    """Read one packet into its record; ProtocolError with a countable cause otherwise. Linear
    in the packet's size (at most MAX_MESSAGE_BYTES and MAX_CONTAINERS objects or arrays)."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError("oversized", f"{len(data)} bytes > {MAX_MESSAGE_BYTES}")
    if data.count(b"{") + data.count(b"[") > MAX_CONTAINERS:  # messages are small and flat
        raise ProtocolError("malformed", f"more than {MAX_CONTAINERS} objects or arrays")
    try:
        fields = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ProtocolError("malformed", str(error)[:200]) from None
    if not isinstance(fields, dict):
        raise ProtocolError("malformed", "not a JSON object")
    if fields.get("v") != PROTOCOL_VERSION or isinstance(fields.get("v"), bool):
        raise ProtocolError("unknown_version", f"version {fields.get('v')!r:.40}")
    kind = fields.get("t")
    record = KINDS.get(kind) if isinstance(kind, str) else None
    if record is None:
        raise ProtocolError("unknown_type", f"type {kind!r:.40}")
    request_id = None
    if record.ANSWERED:
        request_id = fields.get("id")
        if not (is_int(request_id) and 0 <= request_id <= MAX_SEQUENCE):
            raise ProtocolError("missing_id", f"{kind} needs an integer id")
    seq = optional_integer(fields, "s", 1, MAX_SEQUENCE, "bad_sequence")
    dropped = optional_integer(fields, "dropped", 0, MAX_SEQUENCE, "bad_sequence")
    sent_ns = optional_integer(fields, "m", 0, 2**63 - 1, "bad_time")
    state = fields.get("o")
    if state is not None:
        if not isinstance(state, list):
            raise ProtocolError("bad_state", "open sections must be a list")
        if len(state) > MAX_OPEN_SECTIONS:
            raise ProtocolError("budget_open_sections", f"{len(state)} open > {MAX_OPEN_SECTIONS}")
        state = tuple(section_name(name, "open section") for name in state)
    message = record.read(fields)
    return Envelope(message, request_id, seq, state, dropped, sent_ns)
