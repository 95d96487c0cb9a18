"""The frames daemons exchange to replicate the ranks' snapshots: one message of the replica
protocol (a snapshot pushed to the next node, its acknowledgement, a request to pull a rank's
snapshots, and the answer).

    prefix (PREFIX: 56 bytes)  magic, version, header length (<= MAX_HEADER_BYTES),
                               body length, HMAC-SHA256
    header (JSON)              FrameHeader: kind, from, to, rank, world, step, body's sha256,
                               the sender's fresh nonce (hello, challenge) or the one it answers
    body                       a snapshot file (ftd_client/snapshot_format.py), or nothing

A connection opens with a handshake: the client's `hello` carries a fresh random nonce; the
server's `challenge` echoes it (so the server proves it holds the key and, by `source`, that it
is the node the client meant) and carries the server's own; every later frame echoes the
receiver's nonce. A frame captured on one connection is refused on any other (`replayed`).

The MAC covers the prefix's fields and the header, and the header names the body's sha256: a
receiver checks the MAC before it reads a byte of the body, and the body's digest once it has
it. The key is derived from the job secret for the replicas alone (RecordCodec.replica_key), and
the header names the sender and the receiver, so a frame meant for one node is refused by
another. Decoding is bounded: a frame whose lengths exceed what the receiver can take is
refused from its prefix, before anything else is read.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from typing import Annotated, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

MAGIC = b"FTDREPL1"
VERSION = 2
PREFIX = struct.Struct("<8sHHIQ32s")
MAX_HEADER_BYTES = 4096
MAC_BYTES = 32
MAX_STEP = 2**53
MAX_WORLD = 2**20

NONCE_HEX = 32

Kind = Literal["hello", "challenge", "push", "ack", "pull", "snapshot", "end", "refused"]
"""hello (the client's nonce) -> challenge (it echoed, the server's nonce); then
push: a snapshot for the receiver to keep (body) -> ack (step kept) or refused;
pull: the snapshots of one global rank, please -> snapshot* (bodies) then end."""
Nonce = Annotated[str, StringConstraints(pattern=rf"^(|[0-9a-f]{{{NONCE_HEX}}})$")]


class FrameError(ValueError):
    """Bytes that are not a frame this receiver accepts; `cause` is the refusal's name."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause = cause
        self.detail = detail


class FrameHeader(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    kind: Kind
    source: Annotated[str, StringConstraints(min_length=1, max_length=253)]
    to: Annotated[str, StringConstraints(min_length=1, max_length=253)]
    rank: int = Field(0, ge=0, lt=MAX_WORLD)
    world: int = Field(1, ge=1, le=MAX_WORLD)
    step: int = Field(0, ge=0, le=MAX_STEP)
    round: int = Field(0, ge=0, lt=2**31)
    """The sender's round: a step of a newer round may be of another history (a restore)."""
    body_bytes: int = Field(0, ge=0, lt=2**63)
    body_sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")] = hashlib.sha256(
        b""
    ).hexdigest()
    detail: Annotated[str, StringConstraints(max_length=400)] = ""
    nonce: Nonce = ""
    """The sender's fresh nonce: in `hello` and `challenge` only."""
    echo: Nonce = ""
    """The receiver's nonce this frame answers: in every frame but `hello`."""


class Prefix(NamedTuple):
    header_bytes: int
    body_bytes: int
    mac: bytes
    signed: bytes
    """The prefix's bytes the MAC covers (all but the MAC)."""


def encode(key: bytes, header: FrameHeader) -> bytes:
    """The prefix and the header of a frame (its body, `header.body_bytes` long, follows)."""
    head = header.model_dump_json().encode()
    if len(head) > MAX_HEADER_BYTES:
        raise FrameError("oversized", f"a header of {len(head)} bytes")
    signed = PREFIX.pack(MAGIC, VERSION, 0, len(head), header.body_bytes, b"")[:-MAC_BYTES]
    mac = hmac.new(key, signed + head, hashlib.sha256).digest()
    return signed + mac + head


def decode_prefix(data: bytes, max_body_bytes: int) -> Prefix:
    """The lengths a frame's prefix announces, refused when over what the receiver takes."""
    if len(data) != PREFIX.size:
        raise FrameError("malformed", f"{len(data)} bytes: not a frame's prefix")
    magic, version, _, header_bytes, body_bytes, mac = PREFIX.unpack(data)
    if magic != MAGIC or version != VERSION:
        raise FrameError("malformed", "not an ftd replica frame of this version")
    if not 2 <= header_bytes <= MAX_HEADER_BYTES:
        raise FrameError("oversized", f"a header of {header_bytes} bytes")
    if body_bytes > max_body_bytes:
        raise FrameError(
            "oversized", f"a body of {body_bytes} bytes, over the {max_body_bytes} this node takes"
        )
    return Prefix(header_bytes, body_bytes, mac, data[:-MAC_BYTES])


def decode_header(key: bytes, prefix: Prefix, data: bytes, me: str) -> FrameHeader:
    """The header that follows `prefix`, verified: its MAC, its fields, its body's length, and
    that it is meant for this node (`me`)."""
    if len(data) != prefix.header_bytes:
        raise FrameError("malformed", f"{len(data)} header bytes, not {prefix.header_bytes}")
    expected = hmac.new(key, prefix.signed + data, hashlib.sha256).digest()
    if not hmac.compare_digest(expected, prefix.mac):
        raise FrameError(
            "bad_signature",
            "the MAC does not match: forged, altered, or the nodes' job secrets differ",
        )
    try:
        header = FrameHeader.model_validate(json.loads(data))
    except (ValueError, ValidationError, RecursionError) as error:  # signed, yet not ours
        raise FrameError("invalid", str(error).splitlines()[0][:200]) from None
    if header.body_bytes != prefix.body_bytes:
        raise FrameError("invalid", "the header and the prefix disagree on the body's length")
    if header.to != me:
        raise FrameError("misdirected", f"meant for node {header.to!r}, not this one")
    if header.kind in ("push", "snapshot") and header.rank >= header.world:
        raise FrameError("invalid", f"rank {header.rank} of a world of {header.world}")
    if bool(header.nonce) != (header.kind in ("hello", "challenge")):
        raise FrameError("invalid", f"a {header.kind} frame with a nonce or without its own")
    if bool(header.echo) != (header.kind != "hello"):
        raise FrameError("invalid", f"a {header.kind} frame that answers no nonce")
    return header
