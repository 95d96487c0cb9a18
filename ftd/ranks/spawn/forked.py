"""Ranks forked from the zygote, seen from the daemon: their handles, their stdio, reaping.

A forked rank is a child of the daemon (zygote_server makes it so, the daemon being a
subreaper), so it is waited for with waitpid as a subprocess would be.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import IO

from ftd.ranks.spawn.base import RankHandle, RankStream, StreamName
from ftd.ranks.spawn.output import OutputPlan

log = logging.getLogger("ftd.spawn.zygote")

PR_GET_CHILD_SUBREAPER = 37
REAP_TIMEOUT_S = 5.0


class ZygoteGroup:
    """An attempt's ranks forked from the zygote: children of the daemon, each in its own
    session; their redirected output read by the daemon (ftd/ranks/output.py)."""

    def __init__(
        self, ranks: dict[int, RankHandle], attempt_log_dir: str, streams: list[RankStream]
    ) -> None:
        self.ranks = ranks
        self.attempt_log_dir = attempt_log_dir
        self.streams = streams
        self._codes: dict[int, int] = {}

    def reap(self, local_rank: int) -> int | None:
        if local_rank in self._codes:
            return self._codes[local_rank]
        pid = self.ranks[local_rank].pid
        try:
            reaped, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            # Only if someone else waited for it: its status is lost.
            log.error(
                "local rank %d (pid %d) was reaped elsewhere; reporting exit code 1",
                local_rank,
                pid,
            )
            self._codes[local_rank] = 1
            return 1
        if reaped == 0:
            return None
        code = os.waitstatus_to_exitcode(status)
        self._codes[local_rank] = code
        return code

    def kill(self, local_rank: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.ranks[local_rank].pid, sig)

    def close(self) -> None:
        for local_rank in self.ranks:
            if self.reap(local_rank) is None:
                self.kill(local_rank, signal.SIGKILL)
                wait_child(self.ranks[local_rank].pid, REAP_TIMEOUT_S)


@contextlib.contextmanager
def rank_stdio(plan: OutputPlan, local_ranks: list[int]) -> Iterator[list[int]]:
    """Each rank's fds 0, 1 and 2 as PContext would give them: the daemon's own stdin; the
    plan's pipe for a redirected stream, else the daemon's stdout/stderr (or /dev/null)."""
    opened: list[IO[bytes]] = []

    def target(local_rank: int, name: StreamName | None, inherited: int) -> int:
        path = plan.child_path(local_rank, name) if name else os.devnull
        end = plan.child_ends.get((local_rank, name)) if name else None
        if end is not None:
            return end
        if not path:
            return inherited
        file = open(path, "wb")  # noqa: SIM115 - closed below, once sent
        opened.append(file)
        return file.fileno()

    try:
        stdin = 0 if valid_fd(0) else target(0, None, 0)
        fds = []
        for local_rank in local_ranks:
            fds += [stdin, target(local_rank, "stdout", 1), target(local_rank, "stderr", 2)]
        yield fds
    finally:
        for file in opened:
            file.close()


def valid_fd(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def is_subreaper() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    value = ctypes.c_int(0)
    if libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0) != 0:
        return False
    return value.value != 0


def wait_child(pid: int, timeout_s: float) -> int | None:
    """Reap a child of ours within the timeout; its status, or None."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            reaped, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return None
        if reaped:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.01)


def wait_popen(proc: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"
