"""Reading and writing replica frames on asyncio streams, both sides: every read bounded in
bytes (the prefix's lengths checked first) and in time, every write bounded in time (a peer that
reads nothing is dropped); the handshake that binds a connection's frames to it (replica_frame.py);
a file's bytes read and a body written in a small pool of threads of the replicas' own, files
opened so that a FIFO or a link planted in their place is refused, never waited on."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import os
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from ftd.checkpoint.memory_dir import open_slot
from ftd.checkpoint.replica_frame import (
    NONCE_HEX,
    PREFIX,
    FrameError,
    FrameHeader,
    decode_header,
    decode_prefix,
    encode,
)
from ftd.checkpoint.replica_store import Incoming
from ftd.tasks import within

CHUNK_BYTES = 4 << 20
READ_TIMEOUT_S = 10.0
"""The longest a peer may keep the reader waiting for its next bytes."""
WRITE_TIMEOUT_S = 10.0
"""The longest a peer may leave what was sent to it unread."""
IO_THREADS = 4
"""Threads of the replicas' file reads and writes, all of them: none can block for long (no
FIFO is opened, every file is a regular one in memory), and a retry takes no new thread."""

_io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="ftd-replica-io")
T = TypeVar("T")


async def in_thread(
    call: Callable[..., T], *args: Any, undo: Callable[[T], object] | None = None
) -> T:
    """`call(*args)` in the replicas' bounded pool of threads. A caller cancelled meanwhile
    still waits for the call to end, so that no file it uses is closed under it, and `undo`es
    its result (closes the file it opened)."""
    future = asyncio.get_running_loop().run_in_executor(_io, functools.partial(call, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            result = await future
            if undo is not None:
                undo(result)
        raise


def new_nonce() -> str:
    return secrets.token_hex(NONCE_HEX // 2)


def parse_address(address: object) -> tuple[str, int] | None:
    """(host, port) of `host:port` (an IPv6 host in brackets or not); None if it is not one."""
    if not isinstance(address, str) or len(address) > 260:
        return None
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isascii() or not port.isdigit() or len(port) > 5:
        return None
    return (host, int(port)) if 0 < int(port) < 65536 else None


def open_regular(path: Path) -> tuple[int, int]:
    """(fd, size) of `path`, a regular file of this user, opened without following a link and
    without waiting on a FIFO (memory_dir.open_slot); FrameError `not_regular` otherwise.
    Blocking: in a thread."""
    try:
        fd = open_slot(path)
    except OSError as error:
        raise FrameError("not_regular", f"{path.name}: {error.strerror}") from None
    return fd, os.fstat(fd).st_size


def fd_digest(fd: int, nbytes: int) -> str | None:
    """The sha256 of the first `nbytes` of `fd` (blocking: in a thread); None if shorter."""
    digest = hashlib.sha256()
    offset = 0
    while offset < nbytes:
        chunk = os.pread(fd, min(nbytes - offset, CHUNK_BYTES), offset)
        if not chunk:
            return None
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


async def read_exactly(reader: asyncio.StreamReader, nbytes: int) -> bytes:
    try:
        return await within(reader.readexactly(nbytes), READ_TIMEOUT_S)
    except asyncio.IncompleteReadError as error:
        if not error.partial:
            raise EOFError from None
        raise FrameError("truncated", f"{len(error.partial)} of {nbytes} bytes") from None
    except TimeoutError:
        raise FrameError("timeout", f"no bytes for {READ_TIMEOUT_S:.0f} s") from None


async def read_header(
    reader: asyncio.StreamReader, key: bytes, me: str, max_body_bytes: int, echo: str | None
) -> FrameHeader:
    """The next frame's header, verified, and answering `echo` (this side's nonce of the
    connection; None: the hello, which answers none); its body (header.body_bytes) is still to
    be read. EOFError at a clean end of the stream."""
    prefix = decode_prefix(await read_exactly(reader, PREFIX.size), max_body_bytes)
    header = decode_header(key, prefix, await read_exactly(reader, prefix.header_bytes), me)
    if echo is not None and header.echo != echo:
        raise FrameError("replayed", f"a {header.kind} frame of another connection")
    return header


async def read_body(reader: asyncio.StreamReader, incoming: Incoming) -> str:
    """The body, into `incoming`'s file; its sha256."""
    left = incoming.nbytes
    while left:
        chunk = await read_exactly(reader, min(left, CHUNK_BYTES))
        await in_thread(incoming.write, chunk)
        left -= len(chunk)
    return incoming.finish()


async def drain(writer: asyncio.StreamWriter) -> None:
    try:
        await within(writer.drain(), WRITE_TIMEOUT_S)
    except TimeoutError:
        raise FrameError("timeout", f"the peer read nothing for {WRITE_TIMEOUT_S:.0f} s") from None


async def send(
    writer: asyncio.StreamWriter,
    key: bytes,
    header: FrameHeader,
    body: int | None = None,
    still: Callable[[], bool] = lambda: True,
) -> None:
    """One frame; `body` (an open file of at least header.body_bytes) read in chunks in a
    thread, while `still()` holds (OSError once it does not: the file is dropped meanwhile)."""
    writer.write(encode(key, header))
    offset = 0
    while body is not None and offset < header.body_bytes:
        if not still():
            raise OSError(f"the file was dropped at {offset} of {header.body_bytes} bytes")
        size = min(CHUNK_BYTES, header.body_bytes - offset)
        chunk = await in_thread(os.pread, body, size, offset)
        if not chunk:
            raise OSError(f"the file ended at {offset} of {header.body_bytes} bytes")
        writer.write(chunk)
        offset += len(chunk)
        await drain(writer)
    await drain(writer)


async def client_handshake(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes, me: str, node: str
) -> tuple[str, str]:
    """(this side's nonce, the server's) once the server proved it holds the key and is `node`:
    its challenge echoes this side's fresh nonce, signed, from `node`."""
    mine = new_nonce()
    await send(writer, key, FrameHeader(kind="hello", source=me, to=node, nonce=mine))
    challenge = await read_header(reader, key, me, 0, mine)
    if challenge.kind != "challenge" or challenge.source != node:
        raise FrameError(
            "impostor", f"a {challenge.kind} frame of {challenge.source!r}, not {node}'s challenge"
        )
    return mine, challenge.nonce


async def server_handshake(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes, me: str
) -> tuple[str, str, str]:
    """(the client's node id, its nonce, this side's) after its hello and this side's challenge."""
    hello = await read_header(reader, key, me, 0, None)
    if hello.kind != "hello":
        raise FrameError("unexpected", f"a {hello.kind} frame before the hello")
    mine = new_nonce()
    challenge = FrameHeader(
        kind="challenge", source=me, to=hello.source, nonce=mine, echo=hello.nonce
    )
    await send(writer, key, challenge)
    return hello.source, hello.nonce, mine
