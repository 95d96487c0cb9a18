"""The daemon's handle on one zygote process (`zygote_server`): its start, its readiness, one
request of forked ranks at a time, what it says unasked, its end. The start method around it is
`zygote.ZygoteSpawner`."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ftd.ranks.spawn.forked import describe_exit, wait_popen
from ftd.ranks.spawn.zygote_server import MAX_MESSAGE
from ftd.text import is_decimal

log = logging.getLogger("ftd.spawn.zygote")

READY_TIMEOUT_S = 30.0
"""Longest wait for the zygote's preload; under workers.SPAWN_TIMEOUT_S with room to fall back."""
REPLY_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 5.0
ARGV_ROOM, ENV_ROOM = 2048, 16384
"""Bytes of room the zygote is launched with (an argument, a variable of blanks), in which each
rank writes its own command line and environment for /proc to show (see rank_main)."""
DEFAULT_PRELOAD = ("torch", "torch.distributed")
WARM = ("torch._dynamo",)
"""Imported by the zygote once its first ranks have run a while (WARM_AFTER_S), not at its
start: DistributedDataParallel's constructor imports torch._dynamo (and sympy), 2.5 s on two
busy cores that each restarted rank of a DDP job would otherwise pay again; a job that never
restarts, or does not use it, is not delayed by it."""
WARM_AFTER_S = 30
"""Idle seconds after the zygote first forked ranks before it imports WARM: a job that ran this
long is one whose restarts are worth making faster, and its ranks no longer compete with the
import for the CPU. `FTD_ZYGOTE_WARM_AFTER_S` (digits, at most 86400) in the daemon's
environment sets it."""
WARM_AFTER_ENV = "FTD_ZYGOTE_WARM_AFTER_S"
PRELOADING = "preloading"


def warm_after_s(environ: Mapping[str, str] = os.environ) -> int:
    raw = environ.get(WARM_AFTER_ENV, "")
    return int(raw) if is_decimal(raw) and len(raw) <= 5 and int(raw) <= 86400 else WARM_AFTER_S


class ZygoteUnavailable(Exception):
    """This attempt cannot be forked from the zygote; `permanent` when no later one can."""

    def __init__(self, reason: str, permanent: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.permanent = permanent
        self.pids: list[int] = []


class Zygote:
    """The daemon's handle on one zygote process."""

    def __init__(self, preload: Sequence[str], warm: Sequence[str] = ()) -> None:
        self.preload = tuple(preload)
        self.warm = tuple(warm)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {
            **os.environ,
            "OPENBLAS_NUM_THREADS": "1",  # no BLAS thread pool in the zygote
            "FTD_ZYGOTE_ROOM": " " * ENV_ROOM,
        }
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-u",
                    "-m",
                    "ftd.ranks.spawn.zygote_server",
                    str(theirs.fileno()),
                    ",".join(self.preload),
                    ",".join(self.warm) or " ",
                    str(warm_after_s()),
                    " " * ARGV_ROOM,
                ],
                pass_fds=(theirs.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C in a terminal is the daemon's to handle
            )
        finally:
            theirs.close()
        self._sock = ours
        self.fileno = ours.fileno()
        self.closed = False
        self.warming = False
        """The zygote said it is importing its warm modules: a request waits for the import."""
        self._heard: list[dict[str, Any]] = []
        """A reply read by `read_unasked` that was not unasked: the next `_receive`'s."""
        self._ready: dict[str, Any] | None = None
        self._failure: ZygoteUnavailable | None = None
        self.launched_at = time.monotonic()

    @property
    def ready(self) -> bool:
        return self._ready is not None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self) -> None:
        """Blocking: the zygote preloaded and may fork. ZygoteUnavailable otherwise (the same
        one again on every later call: the zygote says it once)."""
        if self._ready is not None:
            return
        if self._failure is not None:
            raise self._failure
        try:
            self._await_ready()
        except ZygoteUnavailable as error:
            self._failure = error
            raise

    def _await_ready(self) -> None:
        remaining = READY_TIMEOUT_S - (time.monotonic() - self.launched_at)
        reply = self._receive(max(remaining, 0.001), PRELOADING)
        if not reply.get("ready"):
            raise ZygoteUnavailable(
                f"--preload failed in the zygote:\n{reply.get('error', '').rstrip()}",
                permanent=True,
            )
        if reply.get("problem"):
            raise ZygoteUnavailable(str(reply["problem"]), permanent=True)
        self._ready = reply
        log.info(
            "zygote (pid %d) ready: preloaded %s in %.2fs",
            self.pid,
            ", ".join(self.preload) or "nothing",
            reply.get("seconds", 0.0),
        )

    def spawn(
        self, common: dict[str, Any], envs: list[dict[str, str]], fds: list[int]
    ) -> list[int]:
        """Blocking (milliseconds): fork the ranks; their pids, already the daemon's children.
        On ZygoteUnavailable, `error.pids` are ranks forked anyway (to be killed)."""
        try:
            self._sock.settimeout(REPLY_TIMEOUT_S)
            message = json.dumps({"common": common, "envs": envs}).encode()
            socket.send_fds(self._sock, [message], fds)
        except OSError as error:
            raise ZygoteUnavailable(f"the zygote (pid {self.pid}) is gone: {error}") from None
        reply = self._receive(READY_TIMEOUT_S if self.warming else REPLY_TIMEOUT_S, "forking ranks")
        pids = [int(pid) for pid in reply.get("pids", [])]
        if "error" in reply or len(pids) != len(envs):
            refused = ZygoteUnavailable(
                f"the zygote refused: {reply.get('error', reply)}",
                permanent=bool(reply.get("unsafe")),
            )
            refused.pids = pids
            raise refused
        return pids

    def _receive(self, timeout_s: float, doing: str) -> dict[str, Any]:
        while True:
            reply = self._receive_one(timeout_s, doing)
            if not self._unasked(reply):
                return reply
            if self.warming:  # the reply waits for the import: as long as a preload may
                timeout_s = max(timeout_s, READY_TIMEOUT_S)

    def read_unasked(self) -> None:
        """Non-blocking, between requests only: take in what the zygote said unasked."""
        while not self.closed:
            self._sock.settimeout(0.0)
            try:
                data = self._sock.recv(MAX_MESSAGE)
                reply = json.loads(data) if data else None
            except (OSError, ValueError):
                return
            if not isinstance(reply, dict):
                return
            if not self._unasked(reply):
                self._heard.append(reply)
                return

    def _unasked(self, reply: dict[str, Any]) -> bool:
        if "warming" in reply:
            self.warming = True
        elif "warmed" in reply:
            self.warming = False
            self._log_warmed(reply)
        else:
            return False
        return True

    def _log_warmed(self, reply: dict[str, Any]) -> None:
        log.info(
            "zygote (pid %d) warmed %s in %.2fs",
            self.pid,
            ", ".join(map(str, reply.get("warmed", []))),
            float(reply.get("seconds", 0.0)),
        )
        for failure in reply.get("failed", []):
            log.warning("zygote (pid %d) could not warm %s (ranks import it)", self.pid, failure)
        if reply.get("problem"):
            log.warning("zygote (pid %d) after warming: %s", self.pid, reply["problem"])

    def _receive_one(self, timeout_s: float, doing: str) -> dict[str, Any]:
        if self._heard:
            return self._heard.pop(0)
        self._sock.settimeout(timeout_s)
        try:
            data = self._sock.recv(MAX_MESSAGE)
        except TimeoutError:
            self.kill()
            raise ZygoteUnavailable(
                f"the zygote (pid {self.pid}) did not answer within {timeout_s:.0f}s while "
                f"{doing}; killed it",
                permanent=doing == PRELOADING,
            ) from None
        except OSError:
            data = b""
        if not data:
            code = wait_popen(self.proc, 1.0)
            raise ZygoteUnavailable(
                f"the zygote (pid {self.pid}) exited ({describe_exit(code)}) while {doing}"
            )
        reply: dict[str, Any] = json.loads(data)
        return reply

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        wait_popen(self.proc, CLOSE_TIMEOUT_S)
        self.closed = True
        self._end_socket()

    def _end_socket(self) -> None:
        """Shut down, then close: a close alone leaves the socket open while the spawner's
        watcher waits on it in select (the zygote then saw no EOF: 5 s, then SIGKILL)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def close(self) -> None:
        """Blocking (briefly): EOF ends the zygote; SIGKILL if it lingers."""
        self.closed = True
        self._end_socket()
        if wait_popen(self.proc, CLOSE_TIMEOUT_S) is None:
            log.warning("zygote (pid %d) did not end on EOF: killed", self.pid)
            self.kill()
