"""A record's body as stored: its JSON, or from COMPRESS_FROM bytes on that JSON deflated and in
base64 (`z:` and the text), so that the stored value stays one line of ASCII on both backends.

What it is for: round 0's closing record lists every member and every node reads it, b N² bytes
in all (issue 43). The rows are alike (names and addresses differ in a few digits), so it packs
8-10 times smaller: 31 MB read at 1,024 nodes becomes 3.4 MB, and a record of 16,384 members
with real names (0.9 MB, most of etcd's 1.5 MiB limit on a request) 0.11 MB.

The MAC covers the stored body: a signed job inflates only what one of its nodes wrote.
Inflating is bounded anyway (an unsigned job, a node of the job turned hostile): the output at
the caller's byte limit, the work linear in the input and that limit."""

from __future__ import annotations

import binascii
import zlib
from dataclasses import dataclass

COMPRESS_FROM = 4096
"""Bodies shorter than this are stored as their JSON (every beat, summary and request)."""
PACKED = b"z:"
"""What begins a packed body (a JSON body begins with `{`)."""
LEVEL = 6


@dataclass(frozen=True)
class BodyRefused:
    cause: str
    """The refusal's counter: `oversized` or `malformed`."""
    detail: str


def pack(body: bytes) -> bytes:
    """The body to store: `body` (JSON), packed where it is long and packing makes it shorter."""
    if len(body) < COMPRESS_FROM:
        return body
    packed = PACKED + binascii.b2a_base64(zlib.compress(body, LEVEL), newline=False)
    return packed if len(packed) < len(body) else body


def unpack(stored: bytes, max_bytes: int) -> bytes | BodyRefused:
    """The JSON of a stored body, at most `max_bytes` long; a body that is not packed is its
    own JSON."""
    if not stored.startswith(PACKED):
        return stored
    try:
        deflated = binascii.a2b_base64(stored[len(PACKED) :], strict_mode=True)
    except binascii.Error as error:
        return BodyRefused("malformed", f"packed body: not base64 ({error})")
    inflate = zlib.decompressobj()
    try:
        body = inflate.decompress(deflated, max_bytes + 1)
    except zlib.error as error:
        return BodyRefused("malformed", f"packed body: not deflate ({error})")
    if len(body) > max_bytes:
        return BodyRefused("oversized", f"packed body inflates past {max_bytes} bytes")
    if not inflate.eof or inflate.unused_data:
        return BodyRefused("malformed", "packed body: truncated or with bytes after its end")
    return body
