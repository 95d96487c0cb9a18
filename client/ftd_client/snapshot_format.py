"""The layout of one rank's snapshot in the node's memory; the rank writes it, the daemon checks
its header before it counts the snapshot complete (standard library only: both sides import it).

A snapshot is one file in the daemon's checkpoint directory (a tmpfs: memory that outlives the
rank). It begins with a fixed header, then the skeleton (the state dict with every tensor
replaced by a reference to its bytes, in ftd_client/checkpoint/_skeleton.py's format: never a
pickle), then the tensors' bytes, each aligned to ALIGN. The header is written last: a file
whose header does not describe the snapshot asked for is no snapshot, whatever its other bytes
hold.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = b"FTDSNAP1"
VERSION = 1
ALIGN = 64
HEADER_BYTES = 4096
"""The header's region: one page, so the skeleton and the tensors start page-aligned."""
HEADER = struct.Struct("<8sIIQIIQQQQQ")
MAX_STEP = 2**53
MAX_WORLD = 2**20
MAX_SNAPSHOT_BYTES = 2**48


class SnapshotFormatError(ValueError):
    """Bytes that are not the header of the snapshot they were said to be."""


@dataclass(frozen=True)
class Header:
    step: int
    world: int
    rank: int
    skeleton_offset: int
    skeleton_bytes: int
    data_offset: int
    data_bytes: int
    total_bytes: int

    def pack(self) -> bytes:
        return HEADER.pack(
            MAGIC,
            VERSION,
            0,
            self.step,
            self.world,
            self.rank,
            self.skeleton_offset,
            self.skeleton_bytes,
            self.data_offset,
            self.data_bytes,
            self.total_bytes,
        )


def layout(step: int, world: int, rank: int, skeleton_bytes: int, data_bytes: int) -> Header:
    """Where a snapshot's parts go: header, skeleton, then the tensors (aligned)."""
    data_offset = align(HEADER_BYTES + skeleton_bytes)
    return Header(
        step=step,
        world=world,
        rank=rank,
        skeleton_offset=HEADER_BYTES,
        skeleton_bytes=skeleton_bytes,
        data_offset=data_offset,
        data_bytes=data_bytes,
        total_bytes=data_offset + data_bytes,
    )


def align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def decode_header(data: bytes, file_bytes: int) -> Header:
    """The header at the start of `data` (a file of `file_bytes`), checked whole: every region
    inside the file, in order, not overlapping. Constant time; SnapshotFormatError otherwise."""
    if len(data) < HEADER.size:
        raise SnapshotFormatError(f"{len(data)} bytes: shorter than a header")
    magic, version, _, step, world, rank, sk_off, sk_len, data_off, data_len, total = (
        HEADER.unpack_from(data)
    )
    if magic != MAGIC or version != VERSION:
        raise SnapshotFormatError("not an ftd snapshot of this version")
    if not (0 <= step <= MAX_STEP and 1 <= world <= MAX_WORLD and 0 <= rank < world):
        raise SnapshotFormatError(f"step {step}, rank {rank} of {world}: out of range")
    if not (
        sk_off == HEADER_BYTES
        and data_off == align(sk_off + sk_len)
        and total == data_off + data_len
        and total <= min(file_bytes, MAX_SNAPSHOT_BYTES)
    ):
        raise SnapshotFormatError(
            f"regions (skeleton {sk_off}+{sk_len}, data {data_off}+{data_len}, total {total}) "
            f"do not fit a file of {file_bytes} bytes"
        )
    return Header(step, world, rank, sk_off, sk_len, data_off, data_len, total)
