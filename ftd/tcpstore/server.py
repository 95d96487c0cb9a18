"""A c10d TCPStore server on the daemon's event loop: torch's clients, no torch in the daemon.

Every store the daemon hosts (the workers' store of each attempt, the rendezvous store, the
in-process rounds' store) is one of these. torch's own server needs `import torch` (2.2 CPU-s
and ~300 MB per daemon) for a few hundred lines of protocol; this one speaks the same protocol
to torch 2.13's C++ client (tests/tcpstore/test_tcpstore.py holds it to torch's server, query
by query).

Per connection, input is decoded by `QueryDecoder` (bounded, linear), replies are written with
flow control (a client that does not read its replies is not read from until it does), and any
refusal or error closes that connection alone, counted under `tcp_store` in
`ftd_input_refused_total`. The store itself holds at most `max_bytes` of keys and values.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Final, cast

from ftd_client.store import LISTEN_BACKLOG, listening_socket

from ftd.refusals import Refusals
from ftd.tcpstore.state import DEFAULT_MAX_BYTES, StoreRefused, StoreState
from ftd.tcpstore.wire import QueryDecoder

log = logging.getLogger("ftd.store")

MAX_CONNECTIONS: Final = 16384
"""The connections a store admits by default: the daemon's own loop, whose descriptors its
ranks' pipes and sockets share. A store in a process of its own admits as many as its
descriptors allow (`max_connections`: ftd/ranks/store_process.py)."""
WRITE_HIGH_WATER_BYTES: Final = 1024 * 1024
"""A connection's unsent replies past this pause reading from it until they drain."""


class StoreConnection(asyncio.Protocol):
    def __init__(self, server: TcpStoreServer) -> None:
        self._server = server
        self._decoder = QueryDecoder()
        self._transport: asyncio.Transport | None = None
        self._writing_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        if not self._server.admit(self):
            self._refuse("too_many_connections")
            return
        self._transport.set_write_buffer_limits(high=WRITE_HIGH_WATER_BYTES)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.release(self)
        self._transport = None

    def data_received(self, data: bytes) -> None:
        self._decoder.feed(data)
        self._serve()

    def pause_writing(self) -> None:
        self._writing_paused = True
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()
            self._serve()

    def send(self, reply: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(reply)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _serve(self) -> None:
        """Carry out the queries received, until none is whole or the client stops reading."""
        try:
            while not self._writing_paused and self._transport is not None:
                query = self._decoder.next()
                if query is None:
                    if self._decoder.refusal is not None:
                        self._refuse(self._decoder.refusal)
                    return
                reply = self._server.state.apply(self, query)
                self._server.served()
                if reply is not None:
                    self.send(reply)
        except StoreRefused as refusal:
            self._refuse(str(refusal))
        except Exception:  # contained: this connection ends, the store and the daemon go on
            log.exception("TCPStore: a query failed; its connection is closed")
            self._refuse("internal_error")

    def _refuse(self, cause: str) -> None:
        self._server.refusals[cause] += 1
        if self._server.refusals[cause] == 1:
            log.warning(
                "TCPStore on port %d: a client's input refused (%s)", self._server.port, cause
            )
        self.close()


class TcpStoreServer:
    """One listening store; `await TcpStoreServer.start(host)` then `port`, and `close()`."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.state = StoreState(self._send, max_bytes)
        self.refusals = Refusals("tcp_store")
        self.port = 0
        self.queries = 0
        """Queries carried out, every connection's (the store's load: bench/scale.py)."""
        self._connections: set[StoreConnection] = set()
        self._server: asyncio.Server | None = None
        self.max_connections = MAX_CONNECTIONS

    @classmethod
    async def start(
        cls, host: str, port: int = 0, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> TcpStoreServer:
        """A store listening on `host` only (a wildcard: every interface), `port` 0: a free one.
        OSError when the address cannot be had."""
        store = cls(max_bytes)
        sock = listening_socket(host, port)
        try:
            # The loop listens on the socket again, with its own backlog (100 by default): a
            # burst of ranks' connections past it was dropped and retried 1 s, 2 s later.
            store._server = await asyncio.get_running_loop().create_server(
                lambda: StoreConnection(store), sock=sock, backlog=LISTEN_BACKLOG
            )
        except BaseException:
            sock.close()
            raise
        store.port = int(sock.getsockname()[1])
        return store

    def served(self) -> None:
        self.queries += 1

    def admit(self, connection: StoreConnection) -> bool:
        if len(self._connections) >= self.max_connections:
            return False
        self._connections.add(connection)
        return True

    def release(self, connection: StoreConnection) -> None:
        self._connections.discard(connection)
        self.state.forget(connection)

    def _send(self, client: object, reply: bytes) -> None:
        assert isinstance(client, StoreConnection)
        client.send(reply)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for connection in list(self._connections):
            connection.close()
        await asyncio.sleep(0)  # the transports' closing callbacks run
