"""NVIDIA's rank-monitor and launcher sockets, served by the daemon, so that code calling
`nvidia_resiliency_ext.fault_tolerance` directly (Megatron-LM, NeMo, Megatron-Bridge) runs
unmodified under `ftd serve`.

ft_launcher gives each rank FT_RANK_MONITOR_IPC_SOCKET (a per-rank monitor process) and
FT_LAUNCHER_IPC_SOCKET (workload-control requests). Here one daemon serves both for every rank
of the node: the kernel's SO_PEERCRED says which rank connected, checked before anything is
read, and each message goes to the same HealthService calls as ftd_client's. Framing and
pickles: ftd/health/nvrx/wire.py. Both sockets are mode 0600; reads never block the loop (a partial
message waits in its connection's buffer); a bad message is counted by cause, logged once per
cause and sender, and its connection closed (a stream cannot be resynchronised).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ftd_client.protocol import ProtocolError

from ftd.health.nvrx import wire as wire
from ftd.health.nvrx.session import ClientSession
from ftd.health.unix_socket import MAX_CONNECTIONS, PREVIOUS_ATTEMPT, accept_ranks, listen_unix
from ftd.ranks.launch import socket_paths
from ftd.refusals import Refusals

log = logging.getLogger("ftd.nvrx")

READ_CHUNK = 64 * 1024
AddReader = Callable[..., None]
RemoveReader = Callable[[int], object]


class NvrxHost(Protocol):
    """What the sockets ask of the health service (HealthService implements it)."""

    def nvrx_authorize(self, pid: int) -> None:
        """Raises ProtocolError unless `pid` is a rank of this daemon or its descendant."""

    def nvrx_message(
        self, session: ClientSession, message: wire.Record, now: float
    ) -> bytes | None:
        """Handle one rank-monitor message; the framed reply, or None where the client reads
        none (a reply it never reads would fill its socket)."""

    def nvrx_disconnected(self, session: ClientSession) -> None: ...

    def nvrx_workload_control(self, pid: int, request: wire.WorkloadControlRequest) -> None: ...


@dataclass
class _Connection:
    sock: socket.socket
    pid: int
    buffer: bytearray = field(default_factory=bytearray)
    session: ClientSession | None = None
    """The rank-monitor socket's: what the client's release expects (session.py)."""


class _StreamServer:
    """A unix stream listener whose connections are read as length-framed messages."""

    def __init__(
        self,
        path: Path,
        authorize: Callable[[int], None],
        on_frame: Callable[[_Connection, bytes, float], bytes | None],
        on_close: Callable[[_Connection], None],
        dropped: collections.Counter[str],
        logged: set[tuple[str, int]],
        previous_pids: set[int],
    ) -> None:
        self.path = path
        self._authorize = authorize
        self._on_frame = on_frame
        self._on_close = on_close
        self.dropped = dropped
        self._logged = logged
        self._previous_pids = previous_pids
        """The ranks of earlier attempts (the rank socket's set): leaving, not strangers."""
        self._listener: socket.socket | None = None
        self._connections: dict[int, _Connection] = {}
        self._paused = False

    def start(
        self, add_reader: Callable[..., None], remove_reader: Callable[[int], object]
    ) -> None:
        self._add, self._remove = add_reader, remove_reader
        listener = self._listener = listen_unix(self.path, socket.SOCK_STREAM)
        self._add(listener.fileno(), self._on_connect)

    def pause(self) -> None:
        if self._listener is None or self._paused:
            return
        self._paused = True
        self._remove(self._listener.fileno())
        for fd in self._connections:
            self._remove(fd)

    def resume(self) -> None:
        if self._listener is None or not self._paused:
            return
        self._paused = False
        self._add(self._listener.fileno(), self._on_connect)
        for fd, connection in self._connections.items():
            self._add(fd, self._on_readable, connection)

    def drain(self) -> None:
        if self._listener is None or self._paused:
            return
        self._on_connect()
        for connection in list(self._connections.values()):
            if connection.sock.fileno() in self._connections:
                self._on_readable(connection)

    def forget_connections(self) -> None:
        for fd in list(self._connections):
            self._hang_up(fd)

    def close(self) -> None:
        self.forget_connections()
        if self._listener is not None:
            if not self._paused:
                self._remove(self._listener.fileno())
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def _refuse(self, conn: socket.socket, cause: str, pid: int, detail: str) -> None:
        conn.close()
        if cause == PREVIOUS_ATTEMPT:  # counted, as on the rank socket, and not said
            self.dropped[f"nvrx_{cause}"] += 1
        else:
            self.drop(cause, pid, detail)

    def _on_connect(self) -> None:
        assert self._listener is not None
        # Identity before a slot (ipc.accept_ranks): a stranger's bytes are never looked at.
        for conn, pid in accept_ranks(
            self._listener, self._authorize, self._previous_pids, self._refuse, "NVRx socket"
        ):
            if len(self._connections) >= MAX_CONNECTIONS:
                self._refuse(conn, "too_many_connections", pid, f"{MAX_CONNECTIONS} open")
                continue
            conn.setblocking(False)
            connection = _Connection(conn, pid)
            self._connections[conn.fileno()] = connection
            self._add(conn.fileno(), self._on_readable, connection)

    def _on_readable(self, connection: _Connection) -> None:
        sock = connection.sock
        while True:
            try:
                data = sock.recv(READ_CHUNK)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                data = b""
            if not data:
                if connection.buffer:
                    self.drop("truncated", connection.pid, "connection closed mid-message")
                self._hang_up(sock.fileno())
                return
            connection.buffer += data
            if not self._frames(connection):
                return

    def _frames(self, connection: _Connection) -> bool:
        """Handle every complete message in the buffer; False once the connection is closed."""
        buffer = connection.buffer
        while len(buffer) >= wire.LENGTH.size:
            (size,) = wire.LENGTH.unpack_from(buffer)
            if size > wire.MAX_MESSAGE_BYTES:
                self.drop("oversized", connection.pid, f"{size} bytes > {wire.MAX_MESSAGE_BYTES}")
                self._hang_up(connection.sock.fileno())
                return False
            end = wire.LENGTH.size + size
            if len(buffer) < end:
                return True
            payload = bytes(buffer[wire.LENGTH.size : end])
            del buffer[:end]
            try:
                reply = self._on_frame(connection, payload, time.monotonic())
            except (wire.Refused, ProtocolError) as refused:
                self.drop(refused.cause, connection.pid, str(refused))
                self._hang_up(connection.sock.fileno())
                return False
            except Exception:  # a bug of ours must not stop the socket serving every rank
                self.dropped["nvrx_internal_error"] += 1
                log.exception("error handling an NVRx message from pid %d", connection.pid)
                self._hang_up(connection.sock.fileno())
                return False
            if reply is not None and not self._send(connection, reply):
                return False
        return True

    def _send(self, connection: _Connection, reply: bytes) -> bool:
        try:
            sent = connection.sock.send(reply, socket.MSG_NOSIGNAL)
        except OSError:
            sent = -1
        if sent != len(reply):  # a rank that does not read its replies is not waited for
            self.drop("reply_failed", connection.pid, "the reply could not be sent whole")
            self._hang_up(connection.sock.fileno())
            return False
        return True

    def _hang_up(self, fd: int) -> None:
        connection = self._connections.pop(fd, None)
        if connection is None:
            return
        if not self._paused:
            self._remove(fd)
        connection.sock.close()
        self._on_close(connection)

    def drop(self, cause: str, pid: int, detail: str) -> None:
        self.dropped[f"nvrx_{cause}"] += 1
        if (cause, pid) not in self._logged:
            self._logged.add((cause, pid))
            log.warning(
                "NVRx socket: dropped a message from pid %d [%s] (%s); further ones are counted",
                pid,
                cause,
                detail,
            )


class NvrxServer:
    """Both of NVRx's sockets for every rank of the node."""

    def __init__(
        self,
        ftd_socket: Path,
        host: NvrxHost,
        dropped: collections.Counter[str] | None = None,
        previous_pids: set[int] | None = None,
    ) -> None:
        self.rank_monitor_path, self.launcher_path = socket_paths(ftd_socket)
        self.dropped: collections.Counter[str] = (
            Refusals("nvrx_socket") if dropped is None else dropped
        )
        """Drops by cause, prefixed `nvrx_` (shared with the rank socket's: /v1/status)."""
        self._host = host
        logged: set[tuple[str, int]] = set()
        previous = set() if previous_pids is None else previous_pids
        self._rank_monitor = _StreamServer(
            self.rank_monitor_path,
            host.nvrx_authorize,
            self._on_rank_message,
            self._on_rank_close,
            self.dropped,
            logged,
            previous,
        )
        self._launcher = _StreamServer(
            self.launcher_path,
            host.nvrx_authorize,
            self._on_launcher_message,
            lambda connection: None,
            self.dropped,
            logged,
            previous,
        )
        self._servers = (self._rank_monitor, self._launcher)

    def start(
        self, add_reader: Callable[..., None], remove_reader: Callable[[int], object]
    ) -> None:
        for server in self._servers:
            server.start(add_reader, remove_reader)

    def pause(self) -> None:
        for server in self._servers:
            server.pause()

    def resume(self) -> None:
        for server in self._servers:
            server.resume()

    def drain(self) -> None:
        for server in self._servers:
            server.drain()

    def forget_connections(self) -> None:
        """The attempt ended: its ranks' connections are closed, as on ftd's socket (their
        messages are no later attempt's, and would be refused as no rank's)."""
        for server in self._servers:
            server.forget_connections()

    def close(self) -> None:
        for server in self._servers:
            server.close()

    def _on_rank_message(self, connection: _Connection, payload: bytes, now: float) -> bytes | None:
        if connection.session is None:
            connection.session = ClientSession(connection.pid)
        return self._host.nvrx_message(connection.session, wire.decode_rank_message(payload), now)

    def _on_rank_close(self, connection: _Connection) -> None:
        self._host.nvrx_disconnected(connection.session or ClientSession(connection.pid))

    def _on_launcher_message(self, connection: _Connection, payload: bytes, now: float) -> bytes:
        _, request = wire.decode_launcher_message(payload)  # the kernel says who sent it
        self._host.nvrx_workload_control(connection.pid, request)
        return wire.ack()
