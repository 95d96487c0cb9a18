"""The rank protocol as tests write it: `packet` is any JSON object as a sender may put it on
the wire (well formed or not); `read` puts it through the daemon's door (ftd_client.wire), as a
rank's packet would be, and gives its Envelope; `message` its record."""

from __future__ import annotations

import json
from typing import Any

from ftd_client import wire
from ftd_client.messages import ProgressReport
from ftd_client.protocol import PROGRESS, PROTOCOL_VERSION
from ftd_client.wire import ANSWERED, Envelope, Message


def packet(fields: dict[str, Any]) -> bytes:
    return json.dumps({"v": PROTOCOL_VERSION, **fields}, separators=(",", ":")).encode()


def read(fields: dict[str, Any]) -> Envelope:
    """`fields` through the door (a request without an id gets one)."""
    if fields.get("t") in ANSWERED and "id" not in fields:
        fields = {"id": 1, **fields}
    return wire.decode(packet(fields))


def message(fields: dict[str, Any]) -> Message:
    return read(fields).message


def progress(fields: dict[str, Any]) -> ProgressReport:
    """A progress report (`t` implied) as the door reads it."""
    report = message({"t": PROGRESS, **fields})
    assert isinstance(report, ProgressReport)
    return report


def fields(envelope: Envelope) -> dict[str, Any]:
    """What a packet of `envelope` would hold (for assertions written on the wire's names)."""
    decoded: dict[str, Any] = json.loads(
        wire.encode(
            envelope.message,
            id=envelope.id,
            seq=envelope.seq,
            open=envelope.open,
            dropped=envelope.dropped,
            sent_ns=envelope.sent_ns,
        )
    )
    return decoded
