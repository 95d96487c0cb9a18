"""Progress records to the rank's node daemon, on a connection of their own.

The sampler (progress.py) sends from its own thread, so its records are no sign of life: a
rank whose main thread hangs goes on sending them. They therefore travel on a separate
connection that never says hello, carries no sequence and no section state, and whose `pg`
messages the daemon reads as observations only; the script's own RankClient (if it has one)
keeps its connection, its numbering and its sections to itself. A send never blocks: a full
queue drops the record (the next one supersedes it), a daemon that went away is reconnected
at most once a second. When the script is done (atexit) the last counts are sent and the
connection closed: the daemon then judges no rank whose interpreter takes its time to exit
(collecting torch's objects took more than 5 s on a busy machine), as it judges no rank gone.
"""

from __future__ import annotations

import atexit
import errno
import os
import socket
import time
from collections.abc import Mapping

from ftd_client import wire
from ftd_client.progress import Observer, Progress, install
from ftd_client.rank_setup import register_stack_dump

ENABLE_ENV = "FTD_PROGRESS"
"""`1`: ftd's rank start installs progress observation in the rank (off by default)."""
RECONNECT_INTERVAL_S = 1.0


class ProgressLink:
    """`send` for progress.install: one non-blocking packet per record (with the signal of
    the rank's stack dump, when it registered one, for a daemon that hears nothing else)."""

    def __init__(self, path: str, stack_signal: int | None = None) -> None:
        self.path = path
        self.stack_signal = stack_signal
        self.dropped = 0
        """Records not handed to the daemon (its queue was full, or it was away)."""
        self._sock: socket.socket | None = None
        self._next_connect = 0.0

    def __call__(self, record: Progress) -> None:
        sock = self._sock or self._connect()
        if sock is None:
            self.dropped += 1
            return
        data = wire.encode(record.message(self.stack_signal), sent_ns=record.sampled_ns)
        try:
            sock.send(data, socket.MSG_NOSIGNAL)
        except OSError as error:
            self.dropped += 1
            if error.errno not in (errno.EAGAIN, errno.ENOBUFS):
                self.close()  # the daemon went away: reconnect on a later record

    def _connect(self) -> socket.socket | None:
        now = time.monotonic()
        if now < self._next_connect:
            return None
        self._next_connect = now + RECONNECT_INTERVAL_S
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.setblocking(False)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            return None
        self._sock = sock
        return sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def install_from_env(environ: Mapping[str, str] = os.environ) -> Observer | None:
    """Observe this rank's progress for its daemon when FTD_PROGRESS=1 and FTD_SOCKET is set,
    and dump its stacks on the daemon's signal (a script without ftd_client has no other
    way to show where it hangs); None otherwise."""
    path = environ.get("FTD_SOCKET")
    if environ.get(ENABLE_ENV) != "1" or not path:
        return None
    _, stack_signal = register_stack_dump()
    link = ProgressLink(path, stack_signal)
    observer = install(link)
    atexit.register(_script_done, observer, link)
    return observer


def _script_done(observer: Observer, link: ProgressLink) -> None:
    observer.stop(timeout_s=1.0)
    observer.tick()
    link.close()
