"""The client side of the replica protocol: a node's push of one step's snapshots to its
successor, each acknowledged; and a replacement node's pull, asking one peer's replica server
for its replicas of a global rank, each verified whole (its frame, its body's digest, its
snapshot header) before it counts."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from ftd.checkpoint.replica_frame import FrameError, FrameHeader
from ftd.checkpoint.replica_store import Incoming, ReplicaStore
from ftd.checkpoint.replica_wire import file_digest, read_body, read_header, send

if TYPE_CHECKING:
    from ftd.checkpoint.replication import Ring

MAX_FETCHED = 16


async def connect(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to a peer's replica server at `host:port` (an IPv6 host in brackets or not)."""
    host, _, port = address.rpartition(":")
    return await asyncio.open_connection(host.strip("[]"), int(port))


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
    acknowledged; FrameError, OSError, EOFError otherwise. Files read in a thread."""
    reader, writer = await connect(address)
    try:
        for rank, path in files:
            nbytes = (await asyncio.to_thread(path.stat)).st_size
            digest = await asyncio.to_thread(file_digest, path, nbytes)
            if digest is None:
                raise FrameError("truncated", f"{path} is shorter than it was")
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
            )
            await send(writer, key, header, path)
            ack = await read_header(reader, key, me, 0)
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
        await send(
            writer, key, FrameHeader(kind="pull", source=me, to=node, rank=rank, world=world)
        )
        while True:
            header = await read_header(reader, key, me, store.ledger.budget_bytes)
            if header.kind == "end":
                return received
            if (header.kind, header.rank, header.world) != ("snapshot", rank, world):
                raise FrameError("unexpected", f"a {header.kind} frame of rank {header.rank}")
            if len(received) >= MAX_FETCHED or not store.room(header.body_bytes):
                raise FrameError("over_budget", f"a snapshot of {header.body_bytes} bytes more")
            incoming = store.incoming(header.body_bytes)
            received.append((header.step, incoming))
            digest = await read_body(reader, incoming)
            await asyncio.to_thread(store.check, header, incoming, digest)
    except BaseException:
        for _, incoming in received:
            incoming.discard()
            store.release(incoming)
        raise
    finally:
        writer.transport.abort()
