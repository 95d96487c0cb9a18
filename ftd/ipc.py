"""The daemon's unix datagram socket for ranks (wire format: ftd_client.protocol).

The socket is mode 0600 and SO_PASSCRED is on, so every datagram arrives with the sender's
pid from the kernel; the daemon accepts messages only from ranks it spawned or their
descendants. Bad datagrams (malformed, oversized, unknown version, not from a rank, out of
order) are dropped, counted by cause, and logged once per cause and sender.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftd_client import protocol
from ftd_client.protocol import ProtocolError

log = logging.getLogger("ftd.ipc")

UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
ANCILLARY_BYTES = socket.CMSG_SPACE(UCRED.size)
RECEIVE_BUFFER_BYTES = 4 * 1024 * 1024

Dispatch = Callable[[int, dict[str, Any], float], dict[str, Any] | None]
"""(sender pid, message, receipt time) -> reply for answered messages; raises ProtocolError."""


class RankSocketServer:
    def __init__(self, path: Path, dispatch: Dispatch) -> None:
        self.path = path
        self._dispatch = dispatch
        self.dropped: collections.Counter[str] = collections.Counter()
        self.received = 0
        self._logged: set[tuple[str, int]] = set()
        self._sock: socket.socket | None = None

    def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        with contextlib.suppress(OSError):  # a larger queue absorbs bursts of heartbeats
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
        sock.setblocking(False)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        previous_umask = os.umask(0o177)  # created 0600: no window where others could connect
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(previous_umask)
        os.chmod(self.path, 0o600)
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._on_readable)

    def close(self) -> None:
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def _on_readable(self) -> None:
        sock = self._sock
        assert sock is not None
        while True:
            try:
                data, ancillary, flags, address = sock.recvmsg(
                    protocol.MAX_MESSAGE_BYTES + 1, ANCILLARY_BYTES
                )
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:
                log.warning("rank socket receive failed: %s", error)
                return
            now = time.monotonic()
            self.received += 1
            pid = _sender_pid(ancillary)
            try:
                if flags & socket.MSG_TRUNC or len(data) > protocol.MAX_MESSAGE_BYTES:
                    raise ProtocolError("oversized", f"more than {protocol.MAX_MESSAGE_BYTES} B")
                message = protocol.decode(data)
                reply = self._dispatch(pid, message, now)
            except ProtocolError as error:
                self._drop(error.cause, pid, str(error))
                if address and isinstance(data, bytes):
                    self._reply_error(address, data, str(error))
                continue
            except Exception:  # a bug of ours must not stop the socket serving every rank
                self.dropped["internal_error"] += 1
                log.exception("error handling a message from pid %d", pid)
                if address and isinstance(data, bytes):
                    self._reply_error(address, data, "internal error in the daemon")
                continue
            if reply is not None and address:
                self._send(address, {"t": protocol.REPLY, "id": message.get("id"), **reply})

    def _drop(self, cause: str, pid: int, detail: str) -> None:
        self.dropped[cause] += 1
        if (cause, pid) not in self._logged:
            self._logged.add((cause, pid))
            log.warning("dropped a message from pid %d (%s); further ones are counted", pid, detail)

    def _reply_error(self, address: Any, data: bytes, error: str) -> None:
        """A request that was understood enough to carry an id gets a negative answer."""
        try:
            request = json.loads(data)
        except ValueError:
            return
        if isinstance(request, dict) and isinstance(request.get("id"), int):
            self._send(
                address, {"t": protocol.REPLY, "id": request["id"], "ok": False, "error": error}
            )

    def _send(self, address: Any, reply: dict[str, Any]) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendto(
                json.dumps({"v": protocol.PROTOCOL_VERSION, **reply}).encode(), address
            )
        except OSError as error:  # the rank went away or its queue is full: it retries or not
            self.dropped["reply_failed"] += 1
            log.debug("reply to %r failed: %s", address, error)


def _sender_pid(ancillary: list[tuple[int, int, bytes]]) -> int:
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid, _uid, _gid = UCRED.unpack(payload[: UCRED.size])
            return int(pid)
    return 0


def parent_pid(pid: int) -> int | None:
    """The parent of `pid` from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # The command name may hold spaces and parentheses: split after the last ')'.
            fields = stat.read().rsplit(b")", 1)[1].split()
        return int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def socket_path(run_dir: Path, daemon_id: str) -> Path:
    """The run directory's `ftd.sock`, unless that path is too long for AF_UNIX (108 bytes)."""
    path = run_dir / "ftd.sock"
    if len(os.fsencode(path)) < 100:
        return path
    import tempfile

    return Path(tempfile.gettempdir()) / f"ftd-{daemon_id}.sock"
