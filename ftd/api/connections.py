"""The API's connections: a cap per listening site, a deadline for each request's head, an
idle timeout between requests, and the peer of each connection (the admin socket's callers
are checked with SO_PEERCRED).

Every connection passes a `ConnectionGuard` before aiohttp sees it: beyond the cap it is
closed at once (counted; logged once per episode), and while it waits for a request head or
sits idle between requests it has one timer. The middlewares tell the connection when a
request starts and ends (`Connections.find(transport)`); a request being handled (an event
stream, say) has no timer here: its handler bounds its own writes.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import socket
import struct
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import cast

from aiohttp import web
from ftd_client.discovery import peer_credentials

log = logging.getLogger("ftd.api")


@dataclass(frozen=True)
class ApiLimits:
    """Bounds that keep the API (and the daemon) reachable whatever clients do. The daemon
    uses the defaults; tests pass short ones."""

    max_connections: int = 256
    """Open TCP connections; beyond it a new one is closed at once."""
    max_admin_connections: int = 32
    """Open connections on the admin unix socket (a budget of its own: a TCP flood does not
    lock the operator out)."""
    header_timeout_s: float = 10.0
    """From a connection's accept, or from the first byte after a response, to a complete
    request head; then the connection is cut."""
    body_timeout_s: float = 10.0
    """To read a request body (408 after it)."""
    idle_timeout_s: float = 30.0
    """A keep-alive connection without a request for this long is closed."""
    max_event_streams: int = 128
    """Concurrent `GET /v1/events` streams; beyond it 429 with Retry-After."""
    stream_max_pending: int = 1000
    """Events a stream may have unwritten; a reader that falls further behind is dropped."""
    stream_write_timeout_s: float = 10.0
    """A write to an event stream that does not complete in this time drops the reader."""
    stream_keepalive_s: float = 15.0
    stream_retry_after_s: int = 5


@dataclass(frozen=True)
class Peer:
    """Who is at the other end: a TCP address, or a process of the daemon's own user on the
    admin socket (`trusted`: it needs no token and no Host check)."""

    trusted: bool
    address: str


class _State(enum.Enum):
    HEAD = "waiting for a request head"
    BUSY = "handling a request"
    IDLE = "idle between requests"


class Connection:
    """One admitted connection: its state and the one timer that state needs."""

    __slots__ = ("_guard", "_last_backlog", "_state", "_timer", "_unread", "peer", "transport")

    def __init__(self, guard: ConnectionGuard, transport: asyncio.Transport, peer: Peer) -> None:
        self._guard = guard
        self.transport = transport
        self.peer = peer
        self._timer: asyncio.TimerHandle | None = None
        self._unread = False
        self._last_backlog = 0
        self._state = _State.HEAD
        self._arm(_State.HEAD, guard.limits.header_timeout_s)

    def _arm(self, state: _State, delay_s: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._state = state
        self._timer = asyncio.get_running_loop().call_later(delay_s, self._expire)

    def data_received(self) -> None:
        if self._state is _State.IDLE:
            self._arm(_State.HEAD, self._guard.limits.header_timeout_s)
        elif self._state is _State.BUSY:
            self._unread = True

    def request_started(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._state = _State.BUSY
        self._unread = False

    def request_finished(self) -> None:
        if self.transport.is_closing():
            return
        if self._unread:  # the next request began while this one was handled
            self._arm(_State.HEAD, self._guard.limits.header_timeout_s)
        else:
            self._last_backlog = 0
            self._arm(_State.IDLE, self._guard.limits.idle_timeout_s)

    def _expire(self) -> None:
        self._timer = None
        if self._state is _State.HEAD:
            self._guard.count_closed("header_timeout")
            self.transport.abort()
            return
        backlog = self.transport.get_write_buffer_size()
        if backlog and (not self._last_backlog or backlog < self._last_backlog):
            # Still sending the last response to a reader that makes progress.
            self._last_backlog = backlog
            self._arm(_State.IDLE, self._guard.limits.idle_timeout_s)
            return
        self._guard.count_closed("idle_timeout")
        if backlog:
            self.transport.abort()
        else:
            self.transport.close()

    def lost(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class Connections:
    """Every open API connection, by transport, across sites: what the middlewares ask."""

    def __init__(self) -> None:
        self._by_transport: dict[asyncio.BaseTransport, Connection] = {}

    def find(self, transport: asyncio.BaseTransport | None) -> Connection | None:
        return None if transport is None else self._by_transport.get(transport)

    def add(self, connection: Connection) -> None:
        self._by_transport[connection.transport] = connection

    def remove(self, connection: Connection) -> None:
        self._by_transport.pop(connection.transport, None)


class RefusalLog:
    """Logs the first refusal of an episode and its end (with the count between), not each
    refusal: a flood must not flood the log."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._refused: dict[str, int] = {}

    def refused(self, reason: str, explanation: str) -> None:
        if reason not in self._refused:
            log.warning(
                "%s: %s; refusing more of them, counted (logged once)", self._what, explanation
            )
            self._refused[reason] = 0
        self._refused[reason] += 1

    def admitted(self) -> None:
        if self._refused:
            counts = ", ".join(f"{n} ({reason})" for reason, n in self._refused.items())
            log.info("%s: accepting again; refused %s meanwhile", self._what, counts)
            self._refused.clear()


PeerCheck = Callable[[asyncio.Transport], "Peer | str"]
"""A connection's Peer, or why it is refused."""


class ConnectionGuard:
    """One listening site's connections: the cap, the timers, the peer check, the counts."""

    def __init__(
        self,
        site: str,
        connections: Connections,
        limits: ApiLimits,
        max_connections: int,
        identify: PeerCheck,
    ) -> None:
        self.site = site
        self.limits = limits
        self._connections = connections
        self._max = max_connections
        self._identify = identify
        self.open = 0
        self.closed: Counter[str] = Counter()
        """Connections the guard closed, by reason (cap, peer, header_timeout, idle_timeout)."""
        self._refusals = RefusalLog(f"API ({site})")

    def count_closed(self, reason: str) -> None:
        self.closed[reason] += 1

    def admit(self, transport: asyncio.Transport) -> Connection | None:
        if self.open >= self._max:
            self.count_closed("cap")
            self._refusals.refused("cap", f"{self.open} connections open, the most it keeps")
            transport.abort()
            return None
        peer = self._identify(transport)
        if isinstance(peer, str):
            self.count_closed("peer")
            self._refusals.refused("peer", peer)
            transport.abort()
            return None
        self._refusals.admitted()
        connection = Connection(self, transport, peer)
        self.open += 1
        self._connections.add(connection)
        return connection

    def forget(self, connection: Connection) -> None:
        connection.lost()
        self.open -= 1
        self._connections.remove(connection)

    def wrap(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: _GuardedProtocol(self, inner)


class _GuardedProtocol(asyncio.Protocol):
    """Admits a connection, then hands everything to aiohttp's protocol (made only then)."""

    def __init__(self, guard: ConnectionGuard, inner: Callable[[], asyncio.Protocol]) -> None:
        self._guard = guard
        self._make_inner = inner
        self._inner: asyncio.Protocol | None = None
        self._connection: Connection | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self._connection = self._guard.admit(cast(asyncio.Transport, transport))
        if self._connection is not None:
            self._inner = self._make_inner()
            self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._connection is not None and self._inner is not None:
            self._connection.data_received()
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._connection is not None:
            self._guard.forget(self._connection)
            self._connection = None
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()


def tcp_peer(transport: asyncio.Transport) -> Peer:
    address = transport.get_extra_info("peername")
    if isinstance(address, tuple) and address:
        return Peer(trusted=False, address=str(address[0]))
    return Peer(trusted=False, address="unknown")


def same_user_peer(transport: asyncio.Transport) -> Peer | str:
    """The admin socket's callers: processes of the daemon's own user (SO_PEERCRED)."""
    try:
        pid, uid, _gid = peer_credentials(transport.get_extra_info("socket"))
    except (AttributeError, OSError, struct.error) as error:
        return f"cannot tell who connected to the admin socket ({error})"
    if uid != os.geteuid():
        return f"a process of uid {uid} (pid {pid}) connected to the admin socket"
    return Peer(trusted=True, address=f"unix socket pid {pid}")


class GuardedSite(web.BaseSite):
    """A listening site whose connections pass a ConnectionGuard. `listen` starts the
    server from a protocol factory (a TCP address, or a bound unix socket)."""

    def __init__(
        self,
        runner: web.BaseRunner,
        guard: ConnectionGuard,
        listen: Callable[[Callable[[], asyncio.Protocol]], Awaitable[asyncio.AbstractServer]],
        name: str,
    ) -> None:
        super().__init__(runner)
        self._guard = guard
        self._listen = listen
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self._server = await self._listen(self._guard.wrap(server))

    @property
    def sockets(self) -> list[socket.socket]:
        # asyncio's and uvloop's servers both have `sockets`; the abstract class does not
        return list(getattr(self._server, "sockets", None) or ())
