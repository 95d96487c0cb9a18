"""The daemon's unix packet socket for ranks (wire format: ftd_client.protocol, read by wire).

The socket is mode 0600; each rank connects once, and the kernel's SO_PEERCRED tells the pid and
uid of the process that connected. A connection is kept only when it comes from this user's
ranks of the current attempt or their descendants, checked when it is accepted: a stranger
never takes a slot, however many connections it opens. Bad messages (malformed, oversized,
unknown version, out of order) are dropped, counted by cause, and logged once per cause and
sender.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import logging
import socket
import struct
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from ftd_client import protocol, wire
from ftd_client.messages import Hello
from ftd_client.protocol import ProtocolError
from ftd_client.wire import Envelope

from ftd import containment
from ftd.health.links import Link
from ftd.health.unix_socket import (
    MAX_CONNECTIONS,
    PREVIOUS_ATTEMPT,
    Authorize,
    accept_ranks,
    listen_unix,
    peer_closed,
)
from ftd.refusals import Refusals

log = logging.getLogger("ftd.ipc")

READING_PAUSE_S = 1.0
READ_BATCH = 512
"""Messages read from one connection per wake-up: a rank that sends without pause cannot keep
the loop from the others (the loop wakes it again while it is readable)."""
BACKLOG_MESSAGES = 64
"""A queue this long when read may have been full: a rank's send buffer holds 278 small
messages at Linux's default size, thousands at ftd's (FTD_SOCKET_SNDBUF)."""
DRAIN_BATCHES = 64
"""A drain before a verdict reads this many batches per connection at most (32k messages:
more than a rank's whole send buffer holds)."""
PACE_S = 0.5
"""A rank client's connection (it said hello) that asked nothing for EAGER_S is read at most
this often: its heartbeats wait in the kernel, each stamped with its time of sending
(SO_TIMESTAMPNS), so the daemon wakes a few times a second instead of once a heartbeat, and
judges by the same times (every verdict drains first). A request makes it eager again."""
EAGER_S = 1.0
MAX_PACED_AGE_S = 2.0
"""A kernel time older than this (a clock step) is taken as this old."""
_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
_TIMESTAMP = struct.Struct("qq")
_ANCILLARY = socket.CMSG_SPACE(_TIMESTAMP.size)

Reply = dict[str, object]
"""A request's answer: `ok`, and what the request asked for (protocol.py)."""
Dispatch = Callable[[Link, Envelope, float], Reply | None]
"""(sender's connection, message, receipt time) -> reply for answered messages; raises
ProtocolError."""


class Follower(Protocol):
    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def drain(self) -> None: ...

    def forget_connections(self) -> None: ...


@dataclasses.dataclass(slots=True)
class _Connection:
    sock: socket.socket
    link: Link
    accepted_at: float
    eager_until: float
    """Until then read at once (PACE_S): its first second, and a second after each request."""
    paceable: bool = False
    """A rank client's connection (it said hello): paced once it asks nothing (PACE_S)."""


def rank_socket_refusals() -> collections.Counter[str]:
    """The messages the ranks' sockets dropped, by cause (NVRx's: `nvrx_`...)."""
    return Refusals("rank_socket", {"nvrx_": "nvrx_socket"})


class RankSocketServer:
    def __init__(
        self,
        path: Path,
        dispatch: Dispatch,
        authorize: Authorize,
        closed: Callable[[Link], None] = lambda link: None,
        followers: Sequence[Follower] = (),
        dropped: collections.Counter[str] | None = None,
        previous_pids: set[int] | None = None,
    ) -> None:
        """`followers`: other rank sockets (NVRx's) paused, resumed and drained with this one,
        sharing its `dropped` counts and `previous_pids`."""
        self.path = path
        self._dispatch = dispatch
        self._authorize = authorize
        self._closed = closed
        """Told when a rank's connection ends (after its last message was dispatched)."""
        self.dropped = dropped if dropped is not None else rank_socket_refusals()
        self.received = 0
        self.previous_pids = previous_pids if previous_pids is not None else set()
        """Ranks of earlier attempts: connections from them are refused without a word."""
        self._logged: set[tuple[str, int]] = set()
        self._listener: socket.socket | None = None
        self._connections: dict[int, _Connection] = {}
        self._link_ids = itertools.count(1)
        self._last_read = float("-inf")
        self.reading_since = 0.0
        """When the daemon began reading without a pause (READING_PAUSE_S): a message sent
        since then waited in a backlog; one sent before waited while nobody read."""
        self._paused = False
        self._resting: set[int] = set()
        """Paced connections not read until the pace timer wakes them (PACE_S)."""
        self._pace_timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.followers = tuple(followers)

    def start(self) -> None:
        listener = self._listener = listen_unix(self.path, socket.SOCK_SEQPACKET)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(listener.fileno(), self._on_connect)

    def pause(self) -> None:
        """Stop reading (the kernel queues connections and messages) until `resume`: while an
        attempt's ranks are spawned, their first messages must wait for their pids to be known."""
        for follower in self.followers:
            follower.pause()
        if self._loop is None or self._paused:
            return
        self._paused = True
        if self._listener is not None:
            self._loop.remove_reader(self._listener.fileno())
        for fd in self._connections:
            self._loop.remove_reader(fd)

    def resume(self) -> None:
        for follower in self.followers:
            follower.resume()
        if self._loop is None or not self._paused:
            return
        self._paused = False
        if self._listener is not None:
            self._loop.add_reader(self._listener.fileno(), self._on_connect)
        self._resting.clear()
        for fd, connection in self._connections.items():
            self._loop.add_reader(fd, self._on_readable, connection)

    def _wake_resting(self) -> None:
        self._pace_timer = None
        if self._loop is None or self._paused:
            return
        for fd in self._resting:
            connection = self._connections.get(fd)
            if connection is not None:
                self._loop.add_reader(fd, self._on_readable, connection)
        self._resting.clear()

    def _rest(self, connection: _Connection) -> None:
        """Read it again in PACE_S: what it sends meanwhile waits in the kernel, timed."""
        assert self._loop is not None
        fd = connection.sock.fileno()
        if self._paused or fd in self._resting or fd not in self._connections:
            return
        self._loop.remove_reader(fd)
        self._resting.add(fd)
        if self._pace_timer is None:
            self._pace_timer = self._loop.call_later(PACE_S, self._wake_resting)

    def drain(self) -> None:
        """Read every message already queued, now: a timer about to judge a rank must not run
        ahead of the rank's queued heartbeats (the event loop runs due timers before I/O)."""
        for follower in self.followers:
            follower.drain()
        if self._loop is None or self._paused or self._listener is None:
            return
        self._on_connect()
        for connection in list(self._connections.values()):
            for _ in range(DRAIN_BATCHES):
                if connection.sock.fileno() not in self._connections:
                    break
                if self._on_readable(connection) < READ_BATCH:
                    break

    def close(self) -> None:
        loop = self._loop
        if loop is None:
            return
        if self._pace_timer is not None:
            self._pace_timer.cancel()
        for fd in list(self._connections):
            self._hang_up(fd)
        if self._listener is not None:
            loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def _on_connect(self) -> None:
        assert self._listener is not None and self._loop is not None
        accepted = accept_ranks(
            self._listener, self._authorize, self.previous_pids, self._refuse, "rank socket"
        )
        for conn, pid in accepted:
            if len(self._connections) >= MAX_CONNECTIONS:
                self._refuse(conn, "too_many_connections", pid, f"{MAX_CONNECTIONS} are open")
                continue
            conn.setblocking(False)
            conn.setsockopt(socket.SOL_SOCKET, _TIMESTAMPNS, 1)
            now = time.monotonic()
            connection = _Connection(conn, Link(next(self._link_ids), pid), now, now + EAGER_S)
            self._connections[conn.fileno()] = connection
            self._loop.add_reader(conn.fileno(), self._on_readable, connection)

    def _refuse(self, conn: socket.socket, cause: str, pid: int, detail: str) -> None:
        conn.close()
        if cause == PREVIOUS_ATTEMPT:  # a rank of an earlier attempt, on its way out
            self.dropped[cause] += 1
        else:
            self._drop(cause, pid, f"refused a connection: {detail}")

    def forget_connections(self) -> None:
        """A new attempt begins: the previous attempt's ranks (still being stopped, or their
        stray children) lose their connections; their messages are not this attempt's."""
        for fd in list(self._connections):
            self._hang_up(fd)
        for follower in self.followers:
            follower.forget_connections()

    def _hang_up(self, fd: int) -> None:
        entry = self._connections.pop(fd, None)
        self._resting.discard(fd)
        if entry is not None and self._loop is not None:
            self._loop.remove_reader(fd)
            entry.sock.close()
            self._closed(entry.link)

    def _on_readable(self, connection: _Connection) -> int:
        """Read up to READ_BATCH messages; how many (READ_BATCH: more may be waiting)."""
        conn, link = connection.sock, connection.link
        pid = link.pid
        for count in range(READ_BATCH):
            try:
                data, ancillary, flags, _ = conn.recvmsg(protocol.MAX_MESSAGE_BYTES + 1, _ANCILLARY)
            except (BlockingIOError, InterruptedError):
                if connection.paceable and time.monotonic() >= connection.eager_until:
                    self._rest(connection)
                return count
            except OSError:
                self._hang_up(conn.fileno())
                return count
            if not data and peer_closed(conn):  # not an empty message: the rank has gone
                self._hang_up(conn.fileno())
                return count
            now = time.monotonic()
            if count == BACKLOG_MESSAGES:  # its queue may have been full: see Link.backlog_at
                link.backlog_at = now
            if now - self._last_read > READING_PAUSE_S:
                self.reading_since = now
            self._last_read = now
            self.received += 1
            try:
                if flags & socket.MSG_TRUNC or len(data) > protocol.MAX_MESSAGE_BYTES:
                    raise ProtocolError("oversized", f"more than {protocol.MAX_MESSAGE_BYTES} B")
                envelope = wire.decode(data)
                if envelope.id is not None:  # a request: its answer is awaited
                    connection.eager_until = now + EAGER_S
                    connection.paceable |= isinstance(envelope.message, Hello)
                reply = self._dispatch(link, envelope, self._sent(connection, ancillary, now))
            except ProtocolError as error:
                self._drop(error.cause, pid, str(error))
                self._reply_error(conn, data, str(error))
                continue
            except Exception as error:  # a bug of ours must not stop serving every rank
                self.dropped["internal_error"] += 1
                containment.record("rank_messages", error)
                self._reply_error(conn, data, "internal error in the daemon")
                continue
            if reply is not None:
                self._send(conn, {"t": protocol.REPLY, "id": envelope.id, **reply})
        return READ_BATCH

    def _sent(
        self, connection: _Connection, ancillary: list[tuple[int, int, bytes]], now: float
    ) -> float:
        """When a paced connection's message was sent (the kernel's stamp, on the monotonic
        clock, never before the connection was accepted); `now` for an eager one."""
        if not connection.paceable or now < connection.eager_until:
            return now
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == _TIMESTAMPNS and len(data) >= 16:
                seconds, nanos = _TIMESTAMP.unpack_from(data)
                mono, age = time.monotonic(), time.time() - (int(seconds) + int(nanos) / 1e9)
                return max(mono - min(max(age, 0.0), MAX_PACED_AGE_S), connection.accepted_at)
        return now

    def _drop(self, cause: str, pid: int, detail: str) -> None:
        self.dropped[cause] += 1
        if (cause, pid) not in self._logged:
            self._logged.add((cause, pid))
            log.warning("dropped a message from pid %d (%s); further ones are counted", pid, detail)

    def _reply_error(self, conn: socket.socket, data: bytes, error: str) -> None:
        """A request that was understood enough to carry an id gets a negative answer."""
        if data.count(b"{") + data.count(b"[") > protocol.MAX_CONTAINERS:
            return  # refused unparsed by decode: parsing it here would recurse as deep
        try:
            request = json.loads(data)
        except (ValueError, RecursionError):
            return
        if isinstance(request, dict) and isinstance(request.get("id"), int):
            self._send(
                conn, {"t": protocol.REPLY, "id": request["id"], "ok": False, "error": error}
            )

    def _send(self, conn: socket.socket, reply: Reply) -> None:
        payload = json.dumps({"v": protocol.PROTOCOL_VERSION, **reply}).encode()
        try:
            conn.send(payload, socket.MSG_NOSIGNAL)
        except OSError as error:  # the rank went away or stopped reading: it retries or not
            self.dropped["reply_failed"] += 1
            log.debug("reply to a rank failed: %s", error)
