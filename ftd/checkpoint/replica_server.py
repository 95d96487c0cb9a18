"""The node's replica server: the TCP port on which its predecessor in the ring pushes snapshots
and a replacement node pulls a lost rank's. Bound to the node's own address (the one it meets
the rendezvous at), never wider.

Everything from the network is hostile until verified: a connection budget (over it, the
connection is closed at once), a handshake first (replica_wire.py: the peer's hello, this node's
challenge, which every later frame must echo: a frame of another connection is `replayed`),
each frame's prefix checked against what the budget can take
before its header is read, the header's MAC and fields before its body is read, the body's
digest and snapshot header before it is kept. Every wait is bounded: 10 s for a peer's next
bytes (its hello, its next request), 10 s for it to read what was sent, ANSWER_S for a whole
answer to a pull, so a peer that sends or reads nothing frees its connection (and the replica
files it had open). Each refusal is counted (`replica` in
ftd_input_refused_total), one event (`replica_refused`, with the peer's address and the reason)
and the connection closed; none is an exception in a task, and a replica kept before stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable

from ftd.checkpoint.replica_frame import FrameError, FrameHeader
from ftd.checkpoint.replica_store import ReplicaStore
from ftd.checkpoint.replica_wire import (
    in_thread,
    read_body,
    read_header,
    send,
    server_handshake,
)
from ftd.refusals import Refusals
from ftd.status.event_kind import EventKind
from ftd.status.events import EventLog

log = logging.getLogger("ftd.checkpoint")

MAX_CONNECTIONS = 8
MAX_PULLED = 8
"""Snapshots of one rank a pull answers with, newest first."""
MAX_EVENTS = 100
ANSWER_S = 30.0
"""The longest a pulling peer may take to read the whole answer (the puller's own bound)."""
"""`replica_refused` events per server: a flood is counted, not written out without end."""


class ReplicaServer:
    def __init__(
        self,
        key: bytes,
        node_id: str,
        store: ReplicaStore,
        events: EventLog,
        on_kept: Callable[[], None] | None = None,
    ) -> None:
        self.key = key
        self.node_id = node_id
        self.store = store
        self.events = events
        self.on_kept = on_kept
        self.refused = Refusals("replica")
        self.pushes = 0
        self.pulls = 0
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._logged: set[str] = set()

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self, host: str) -> None:
        self._server = await asyncio.start_server(self._accept, host, 0, limit=1 << 16)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._connections):
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.gather(*self._connections, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = _address(writer)
        if len(self._connections) >= MAX_CONNECTIONS:
            self._refuse(peer, "too_many_connections", f"{MAX_CONNECTIONS} are open already")
            writer.transport.abort()
            return
        task = asyncio.ensure_future(self._serve(reader, writer, peer))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str
    ) -> None:
        try:
            client, theirs, mine = await server_handshake(reader, writer, self.key, self.node_id)
            while True:
                header = await read_header(reader, self.key, self.node_id, self._max_body(), mine)
                if header.source != client:
                    raise FrameError("replayed", f"a frame of {header.source!r} from {client!r}")
                if header.kind == "push":
                    await self._keep(reader, writer, header, theirs)
                elif header.kind == "pull":
                    async with asyncio.timeout(ANSWER_S):
                        await self._answer_pull(writer, header, theirs)
                else:
                    raise FrameError("unexpected", f"a {header.kind!r} frame to the server")
        except EOFError:
            pass
        except FrameError as error:  # the sender sees the connection close: no acknowledgement
            self._refuse(peer, error.cause, error.detail)
        except TimeoutError:
            self._refuse(peer, "timeout", f"an answer not read in {ANSWER_S:.0f} s")
        except OSError as error:
            log.debug("replica connection from %s: %s", peer, error)
        except Exception:  # contained: a peer's connection never takes the server down
            log.exception("replica connection from %s failed", peer)
        finally:
            writer.transport.abort()

    def _max_body(self) -> int:
        return max(self.store.ledger.budget_bytes, 0)

    async def _keep(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        header: FrameHeader,
        echo: str,
    ) -> None:
        if not self.store.room(header.body_bytes):
            raise FrameError(
                "over_budget",
                f"a replica of {header.body_bytes} bytes does not fit --checkpoint-memory "
                f"{self.store.ledger.budget_bytes} beside what this node holds",
            )
        incoming = self.store.incoming(header.body_bytes)
        try:
            digest = await read_body(reader, incoming)
            await in_thread(self.store.check, header, incoming, digest)
            self.store.keep(header, incoming)
        finally:
            incoming.discard()  # kept: already renamed away; else removed
            self.store.release(incoming)
        self.pushes += 1
        if self.on_kept is not None:
            self.on_kept()
        ack = FrameHeader(
            kind="ack",
            source=self.node_id,
            to=header.source,
            rank=header.rank,
            world=header.world,
            step=header.step,
            echo=echo,
        )
        await send(writer, self.key, ack)

    async def _answer_pull(
        self, writer: asyncio.StreamWriter, header: FrameHeader, echo: str
    ) -> None:
        self.pulls += 1
        for replica in self.store.newest(header.rank, header.world, MAX_PULLED):
            with self.store.reading(replica) as fd:
                if fd is None or not self.store.holds(replica):  # dropped meanwhile
                    continue
                frame = FrameHeader(
                    kind="snapshot",
                    source=self.node_id,
                    to=header.source,
                    rank=replica.rank,
                    world=replica.world,
                    step=replica.step,
                    body_bytes=replica.nbytes,
                    body_sha256=replica.sha256,
                    echo=echo,
                )
                still = functools.partial(self.store.holds, replica)
                await send(writer, self.key, frame, fd, still)
        end = FrameHeader(kind="end", source=self.node_id, to=header.source, echo=echo)
        await send(writer, self.key, end)

    def _refuse(self, peer: str, cause: str, detail: str) -> None:
        self.refused[cause] += 1
        if sum(self.refused.values()) <= MAX_EVENTS:
            self.events.emit(EventKind.REPLICA_REFUSED, source=peer, reason=cause, detail=detail)
        if cause not in self._logged:
            self._logged.add(cause)
            log.warning("refused a replica frame from %s (%s): %s", peer, cause, detail)


def _address(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return "unknown"
