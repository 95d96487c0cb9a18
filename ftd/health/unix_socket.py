"""Unix sockets for ranks: a private listener, who is at the other end (SO_PEERCRED), which
connections to accept, and where the ranks' socket goes (ftd's own and NVRx's servers)."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

from ftd_client.protocol import ProtocolError

log = logging.getLogger("ftd.ipc")

UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
MAX_CONNECTIONS = 4096
PREVIOUS_ATTEMPT = "previous_attempt"
LISTEN_BACKLOG = 1024

Authorize = Callable[[int], object]
"""(sender pid) -> None when the pid is a rank or a rank's descendant; raises ProtocolError."""


def accept_ranks(
    listener: socket.socket,
    authorize: Authorize,
    previous_pids: set[int],
    refuse: Callable[[socket.socket, str, int, str], None],
    what: str,
) -> Iterator[tuple[socket.socket, int]]:
    """Accept every pending connection; yield (connection, pid) for those from this user's
    ranks of the current attempt and their descendants. Identity before a slot: the others are
    handed to `refuse` (cause, pid, detail) at once and take nothing."""
    while True:
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            log.warning("%s: accept failed: %s", what, error)
            return
        pid, uid = _peer(conn)
        if uid != os.geteuid():
            refuse(conn, "wrong_user", pid, f"pid {pid} runs as uid {uid}")
            continue
        if pid in previous_pids:
            refuse(conn, PREVIOUS_ATTEMPT, pid, "a rank of an earlier attempt")
            continue
        try:
            authorize(pid)
        except ProtocolError as error:
            refuse(conn, error.cause, pid, str(error))
            continue
        yield conn, pid


def _peer(conn: socket.socket) -> tuple[int, int]:
    """The connecting process's pid and uid, from the kernel (SO_PEERCRED)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, UCRED.size)
    pid, uid, _ = UCRED.unpack(creds)
    return int(pid), int(uid)


def listen_unix(path: Path, kind: socket.SocketKind) -> socket.socket:
    """A non-blocking unix listener at `path` (replacing a stale one), created mode 0600."""
    listener = socket.socket(socket.AF_UNIX, kind)
    listener.setblocking(False)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    previous_umask = os.umask(0o177)  # created 0600: no window where others could connect
    try:
        listener.bind(str(path))
    finally:
        os.umask(previous_umask)
    os.chmod(path, 0o600)
    listener.listen(LISTEN_BACKLOG)
    return listener


def peer_closed(conn: socket.socket) -> bool:
    """Whether the peer hung up. A packet socket reads an empty message and the end of the
    stream alike; only the hang-up flag tells them apart."""
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLRDHUP)
    return any(events & (select.POLLHUP | select.POLLRDHUP) for _, events in poller.poll(0))


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
    """The run directory's `ftd.sock`, unless that directory leaves no room for AF_UNIX's 108
    bytes (NVRx's sockets go beside it, with names 14 bytes longer): then `ftd.sock` in a
    fresh private directory (mkdtemp: this user's, mode 0700, a name nobody could take first),
    which the daemon removes at teardown."""
    path = run_dir / "ftd.sock"
    if len(os.fsencode(path)) < 90:
        return path
    import tempfile

    return Path(tempfile.mkdtemp(prefix=f"ftd-{daemon_id}-")) / "ftd.sock"
