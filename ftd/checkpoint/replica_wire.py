"""Reading and writing replica frames on asyncio streams, both sides: every read bounded in
bytes (the prefix's lengths checked first) and in time; a body streamed to its file and its
hash in a thread, a file's bytes read in a thread, so a snapshot never blocks the loop."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

from ftd.checkpoint.replica_frame import (
    PREFIX,
    FrameError,
    FrameHeader,
    decode_header,
    decode_prefix,
    encode,
)
from ftd.checkpoint.replica_store import Incoming

CHUNK_BYTES = 4 << 20
READ_TIMEOUT_S = 10.0
"""The longest a peer may keep the reader waiting for its next bytes."""


async def read_exactly(reader: asyncio.StreamReader, nbytes: int) -> bytes:
    try:
        return await asyncio.wait_for(reader.readexactly(nbytes), READ_TIMEOUT_S)
    except asyncio.IncompleteReadError as error:
        if not error.partial:
            raise EOFError from None
        raise FrameError("truncated", f"{len(error.partial)} of {nbytes} bytes") from None
    except TimeoutError:
        raise FrameError("timeout", f"no bytes for {READ_TIMEOUT_S:.0f} s") from None


async def read_header(
    reader: asyncio.StreamReader, key: bytes, me: str, max_body_bytes: int
) -> FrameHeader:
    """The next frame's header, verified; its body (header.body_bytes) is still to be read.
    EOFError at a clean end of the stream."""
    prefix = decode_prefix(await read_exactly(reader, PREFIX.size), max_body_bytes)
    return decode_header(key, prefix, await read_exactly(reader, prefix.header_bytes), me)


async def read_body(reader: asyncio.StreamReader, incoming: Incoming) -> str:
    """The body, into `incoming`'s file; its sha256."""
    left = incoming.nbytes
    while left:
        chunk = await read_exactly(reader, min(left, CHUNK_BYTES))
        await asyncio.to_thread(incoming.write, chunk)
        left -= len(chunk)
    return incoming.finish()


async def send(
    writer: asyncio.StreamWriter, key: bytes, header: FrameHeader, body: Path | None = None
) -> None:
    """One frame; `body` (a snapshot file of header.body_bytes) read in chunks in a thread."""
    writer.write(encode(key, header))
    if body is not None:
        fd = await asyncio.to_thread(os.open, body, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            offset = 0
            while offset < header.body_bytes:
                size = min(CHUNK_BYTES, header.body_bytes - offset)
                chunk = await asyncio.to_thread(os.pread, fd, size, offset)
                if not chunk:
                    raise OSError(f"{body} ended at {offset} of {header.body_bytes} bytes")
                writer.write(chunk)
                offset += len(chunk)
                await writer.drain()
        finally:
            os.close(fd)
    await writer.drain()


def file_digest(path: Path, nbytes: int) -> str | None:
    """The sha256 of the first `nbytes` of `path` (blocking: in a thread); None if shorter."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as snapshot:
        left = nbytes
        while left:
            chunk = snapshot.read(min(left, CHUNK_BYTES))
            if not chunk:
                return None
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()
