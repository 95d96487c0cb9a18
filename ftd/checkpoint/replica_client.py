"""The client side of the replica protocol: a node's push of one step's snapshots to its
successor, each acknowledged; and a replacement node's pull, asking one peer's replica server
for its replicas of a global rank, each verified whole (its frame, its body's digest, its
snapshot header) before it counts. Both open with the handshake (replica_wire.py): nothing is
sent to a server that has not proved it holds the job's key and is the node the summary named,
so a port taken by someone else gets no snapshot."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ftd.checkpoint.replica_frame import FrameError, FrameHeader
from ftd.checkpoint.replica_store import Incoming, ReplicaStore
from ftd.checkpoint.replica_wire import (
    client_handshake,
    fd_digest,
    in_thread,
    open_regular,
    parse_address,
    read_body,
    read_header,
    send,
)

if TYPE_CHECKING:
    from ftd.checkpoint.replica_ring import Ring

MAX_FETCHED = 16


async def connect(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to a peer's replica server at `host:port` (an IPv6 host in brackets or not);
    FrameError (`bad_address`) for anything else."""
    parsed = parse_address(address)
    if parsed is None:
        raise FrameError("bad_address", f"{address[:80]!r} is not host:port")
    return await asyncio.open_connection(*parsed)


def _snapshot(path: Path) -> tuple[int, int, str]:
    """(fd, size, sha256) of a slot's file, refused unless a regular file (blocking)."""
    fd, nbytes = open_regular(path)
    try:
        digest = fd_digest(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    if digest is None:
        os.close(fd)
        raise FrameError("truncated", f"{path.name} is shorter than it was")
    return fd, nbytes, digest


def _close(opened: tuple[int, int, str]) -> None:
    os.close(opened[0])


async def push(
    key: bytes,
    me: str,
    successor: str,
    address: str,
    step: int,
    ring: Ring,
    files: list[tuple[int, Path]],
) -> None:
    """Each (global rank, snapshot file) of `step` to `successor`, one after the other, each
    acknowledged; FrameError, OSError, EOFError otherwise. Files read in the replicas' threads."""
    reader, writer = await connect(address)
    try:
        mine, theirs = await client_handshake(reader, writer, key, me, successor)
        for rank, path in files:
            fd, nbytes, digest = await in_thread(_snapshot, path, undo=_close)
            try:
                header = FrameHeader(
                    kind="push",
                    source=me,
                    to=successor,
                    rank=rank,
                    world=ring.world,
                    step=step,
                    round=ring.number,
                    body_bytes=nbytes,
                    body_sha256=digest,
                    echo=theirs,
                )
                await send(writer, key, header, fd)
            finally:
                os.close(fd)
            ack = await read_header(reader, key, me, 0, mine)
            if (ack.kind, ack.rank, ack.step) != ("ack", rank, step):
                raise FrameError("unexpected", f"a {ack.kind} frame for a push")
    finally:
        writer.transport.abort()


async def fetch(
    key: bytes, me: str, node: str, address: str, rank: int, world: int, store: ReplicaStore
) -> list[tuple[int, Incoming]]:
    """(step, its file) of each snapshot `node` holds of `rank` in a job of `world` ranks; the
    caller adopts or drops them. FrameError, OSError, EOFError when the peer's answer is not
    one (then nothing is kept of it)."""
    reader, writer = await connect(address)
    received: list[tuple[int, Incoming]] = []
    try:
        mine, theirs = await client_handshake(reader, writer, key, me, node)
        pull = FrameHeader(kind="pull", source=me, to=node, rank=rank, world=world, echo=theirs)
        await send(writer, key, pull)
        while True:
            header = await read_header(reader, key, me, store.ledger.budget_bytes, mine)
            if header.kind == "end":
                return received
            if (header.kind, header.rank, header.world) != ("snapshot", rank, world):
                raise FrameError("unexpected", f"a {header.kind} frame of rank {header.rank}")
            if len(received) >= MAX_FETCHED or not store.room(header.body_bytes):
                raise FrameError("over_budget", f"a snapshot of {header.body_bytes} bytes more")
            incoming = store.incoming(header.body_bytes)
            received.append((header.step, incoming))
            digest = await read_body(reader, incoming)
            await in_thread(store.check, header, incoming, digest)
    except BaseException:
        for _, incoming in received:
            incoming.discard()
            store.release(incoming)
        raise
    finally:
        writer.transport.abort()
