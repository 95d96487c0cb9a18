"""The orphan guard: ranks die with the daemon, even when the daemon is SIGKILLed.

A tiny process, started once per daemon in its own session, reads a pipe whose only writer is
the daemon. The daemon registers each rank's process group on it. When the pipe reaches EOF
(the daemon exited in any way, SIGKILL included) the guard SIGKILLs every process group still
registered, then every process whose environment carries the daemon's FTD_DAEMON_ID (a rank's
descendant that left its process group), then exits. This gives PR_SET_PDEATHSIG's guarantee,
and more, without a `preexec_fn` in the spawn path, and costs nothing per restart.

Wire format, one line each: `+<pgid>` registers, `-<pgid>` unregisters.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable

from ftd.text import is_decimal


class OrphanGuard:
    """The daemon's side: owns the write end of the pipe."""

    def __init__(self, daemon_id: str) -> None:
        read_fd, self._write_fd = os.pipe()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "ftd.ranks.guard", str(read_fd), daemon_id],
            pass_fds=(read_fd,),
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
        os.close(read_fd)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def register(self, pgid: int) -> None:
        self._write(f"+{pgid}\n")

    def unregister(self, pgid: int) -> None:
        self._write(f"-{pgid}\n")

    def _write(self, line: str) -> None:
        # A short line into a pipe the guard drains at once never blocks in practice; a guard
        # that died is survivable (we only lose the SIGKILL-of-the-daemon guarantee).
        with contextlib.suppress(OSError):
            os.write(self._write_fd, line.encode())

    def close(self) -> None:
        """Blocking (briefly): EOF to the guard, then reap it."""
        if self._write_fd >= 0:
            os.close(self._write_fd)
            self._write_fd = -1
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class GuardKeeper:
    """The daemon's one guard, kept alive: the process groups it watches are remembered here,
    and if the guard dies (killed, OOM) a new one is started with them, and it is said."""

    def __init__(self, daemon_id: str, on_restart: Callable[[int, int], object]) -> None:
        self._daemon_id = daemon_id
        self._on_restart = on_restart
        """(old pid, new pid) after a guard died and was replaced."""
        self._groups: set[int] = set()
        self._guard = OrphanGuard(daemon_id)
        self._pidfd = -1
        self._closed = False

    @property
    def pid(self) -> int:
        return self._guard.pid

    def watch(self) -> None:
        """From the event loop's thread: notice the guard's death at once (pidfd)."""
        import asyncio

        self._pidfd = os.pidfd_open(self._guard.pid)
        asyncio.get_running_loop().add_reader(self._pidfd, self._guard_died)

    def _guard_died(self) -> None:
        import asyncio
        import logging

        loop = asyncio.get_running_loop()
        loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = -1
        if self._closed:
            return
        old = self._guard
        old.close()  # reaps it
        self._guard = OrphanGuard(self._daemon_id)
        for pgid in self._groups:
            self._guard.register(pgid)
        logging.getLogger("ftd.guard").error(
            "the orphan guard (pid %d) died: started another (pid %d) watching %d process groups",
            old.pid,
            self._guard.pid,
            len(self._groups),
        )
        self._on_restart(old.pid, self._guard.pid)
        self.watch()

    def register(self, pgid: int) -> None:
        self._groups.add(pgid)
        self._guard.register(pgid)

    def unregister(self, pgid: int) -> None:
        self._groups.discard(pgid)
        self._guard.unregister(pgid)

    def close(self) -> None:
        """Blocking (briefly); from the loop's thread first `unwatch`."""
        self._closed = True
        self._guard.close()

    def unwatch(self) -> None:
        if self._pidfd >= 0:
            import asyncio

            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1


def tagged_pids(daemon_id: str) -> list[int]:
    """Processes whose environment carries FTD_DAEMON_ID=<daemon_id>: a daemon's ranks and
    whatever they started, wherever it was re-parented."""
    marker = f"FTD_DAEMON_ID={daemon_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not is_decimal(entry):
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if marker in environ.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def kill_tagged(daemon_id: str, skip: frozenset[int] = frozenset()) -> list[int]:
    """SIGKILL every tagged process but `skip`; repeated while new ones appear (forks)."""
    killed: list[int] = []
    for _ in range(5):
        targets = [pid for pid in tagged_pids(daemon_id) if pid not in skip and pid not in killed]
        if not targets:
            break
        for pid in targets:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:
                pass
    return killed


def _serve(read_fd: int, daemon_id: str) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    pgids: set[int] = set()
    pending = b""
    while chunk := os.read(read_fd, 4096):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line[:1] == b"+":
                pgids.add(int(line[1:]))
            elif line[:1] == b"-":
                pgids.discard(int(line[1:]))
    for pgid in pgids:
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)
    kill_tagged(daemon_id, skip=frozenset({os.getpid()}))


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2])
