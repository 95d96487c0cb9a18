"""The zygote start method: ranks forked from a process that already imported torch.

The daemon launches one zygote at start (`zygote_server`); each attempt's ranks are forked
from it, so a restart does not pay for `import torch` again. A rank forked this way ends up a
child of the daemon (see zygote_server), so `ZygoteGroup` waits for it with waitpid like the
subprocess method does, and logs, error files and exit codes look the same to the supervisor.

What cannot run from a fork starts the ordinary way (`PContextSpawner`), with the reason in
the log: a binary (--no-python), another interpreter (PYTHON_EXEC), a preload that failed to
import, a zygote that holds threads or initialised CUDA, a daemon that is not a subreaper.
A zygote that dies is replaced as soon as that is seen.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from ftd.config.serve import NO_PRELOAD
from ftd.ranks.spawn.base import LaunchSpec, RankHandle, StartedGroup
from ftd.ranks.spawn.forked import (
    ZygoteGroup,
    describe_exit,
    is_subreaper,
    rank_stdio,
    wait_child,
    wait_popen,
)
from ftd.ranks.spawn.output import plan_output
from ftd.ranks.spawn.pcontext import PContextSpawner
from ftd.ranks.spawn.zygote_server import MAX_MESSAGE, MAX_RANKS_PER_REQUEST

log = logging.getLogger("ftd.spawn.zygote")

READY_TIMEOUT_S = 30.0
"""Longest wait for the zygote's preload; under workers.SPAWN_TIMEOUT_S with room to fall back."""
REPLY_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 5.0
ARGV_ROOM, ENV_ROOM = 2048, 16384
"""Bytes of room the zygote is launched with (an argument, a variable of blanks), in which each
rank writes its own command line and environment for /proc to show (see rank_main)."""
DEFAULT_PRELOAD = ("torch", "torch.distributed")
PRELOADING = "preloading"


class ZygoteUnavailable(Exception):
    """This attempt cannot be forked from the zygote; `permanent` when no later one can."""

    def __init__(self, reason: str, permanent: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.permanent = permanent
        self.pids: list[int] = []


class Zygote:
    """The daemon's handle on one zygote process."""

    def __init__(self, preload: Sequence[str]) -> None:
        self.preload = tuple(preload)
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
        self._ready: dict[str, Any] | None = None
        self._failure: ZygoteUnavailable | None = None
        self.launched_at = time.monotonic()

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
        reply = self._receive(REPLY_TIMEOUT_S, "forking ranks")
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
        self._sock.close()

    def close(self) -> None:
        """Blocking (briefly): EOF ends the zygote; SIGKILL if it lingers."""
        self._sock.close()
        if wait_popen(self.proc, CLOSE_TIMEOUT_S) is None:
            self.kill()


class ZygoteSpawner:
    name = "zygote"

    def __init__(self, preload: Sequence[str] = ()) -> None:
        self._preload = (
            ()
            if tuple(preload) == (NO_PRELOAD,)
            else tuple(dict.fromkeys((*DEFAULT_PRELOAD, *preload)))
        )
        self._fallback = PContextSpawner()
        self._lock = threading.Lock()
        self._disabled: str | None = None
        self._last_reason: str | None = None
        self._closed = False
        self._eager_restarts = 1
        self._zygote: Zygote | None = self._launch()

    def _launch(self) -> Zygote:
        zygote = Zygote(self._preload)
        preloading = ", ".join(self._preload) or "nothing"
        log.info("zygote (pid %d) started: preloading %s", zygote.pid, preloading)
        threading.Thread(
            target=self._watch, args=(zygote,), name=f"ftd-zygote-{zygote.pid}", daemon=True
        ).start()
        return zygote

    def _watch(self, zygote: Zygote) -> None:
        """Start a new zygote as soon as this one dies, so that the next restart is warm;
        once per attempt at most (a zygote that keeps dying is started again by `start`)."""
        with contextlib.suppress(ProcessLookupError):
            fd = os.pidfd_open(zygote.pid)
            try:
                select.select([fd], [], [])
            finally:
                os.close(fd)
        with self._lock:
            if self._closed or zygote is not self._zygote or not self._eager_restarts:
                return
            self._eager_restarts -= 1
            self._zygote = self._replace_dead(zygote)

    def start(self, spec: LaunchSpec) -> StartedGroup:
        with self._lock:
            self._eager_restarts = 1
            try:
                return self._start_forked(spec)
            except ZygoteUnavailable as error:
                if error.permanent:
                    self._disable(error.reason)
                self._log_fallback(error.reason)
                return self._fallback.start(spec)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._zygote is not None:
                self._zygote.close()
                self._zygote = None
            self._fallback.close()

    def _disable(self, reason: str) -> None:
        self._disabled = reason
        if self._zygote is not None:
            self._zygote.kill()
            self._zygote = None

    def _log_fallback(self, reason: str) -> None:
        # A change of state is logged once; the same reason again at the next attempt is not.
        if reason != self._last_reason:
            log.warning("start method zygote: %s; starting the ranks the ordinary way", reason)
            self._last_reason = reason
        else:
            log.debug("start method zygote: %s; starting the ranks the ordinary way", reason)

    def _command(self, cmd: tuple[str, ...]) -> tuple[bool, str, list[str]]:
        """(module, target, args) of `python -u [-m] target args`; ZygoteUnavailable if the
        command is anything else."""
        if len(cmd) < 3 or cmd[1] != "-u":
            raise ZygoteUnavailable(
                f"{cmd[0]!r} is not a Python script (--no-python); a binary cannot be forked "
                "from the zygote",
                permanent=True,
            )
        if cmd[0] != sys.executable:
            raise ZygoteUnavailable(
                f"the ranks' interpreter {cmd[0]!r} (PYTHON_EXEC) is not the daemon's "
                f"{sys.executable!r}",
                permanent=True,
            )
        module = cmd[2] == "-m"
        rest = list(cmd[3:] if module else cmd[2:])
        if not rest:
            raise ZygoteUnavailable(f"cannot parse the command {cmd!r}", permanent=True)
        return module, rest[0], rest[1:]

    def prepare(self) -> None:
        """Wait for the zygote's preload (without the lock: `close` may end the wait)."""
        zygote = self._zygote
        if zygote is not None and self._disabled is None:
            with contextlib.suppress(ZygoteUnavailable):
                zygote.wait_ready()

    def _ready_zygote(self) -> Zygote:
        if self._disabled is not None:
            raise ZygoteUnavailable(self._disabled)
        if not is_subreaper():
            raise ZygoteUnavailable(
                "the daemon is not a child subreaper, so forked ranks would not be its children",
                permanent=True,
            )
        zygote = self._zygote
        if zygote is not None and not zygote.alive():
            zygote = self._zygote = self._replace_dead(zygote)
        if zygote is None:
            zygote = self._zygote = self._launch()
        try:
            zygote.wait_ready()
        except ZygoteUnavailable:
            if not zygote.alive() or zygote is not self._zygote:
                self._zygote = None
            raise
        return zygote

    def _replace_dead(self, zygote: Zygote) -> Zygote:
        zygote.kill()  # reaps it, closes our end
        log.warning(
            "zygote (pid %d) died (%s); starting a new one",
            zygote.pid,
            describe_exit(zygote.proc.returncode),
        )
        return self._launch()

    def _start_forked(self, spec: LaunchSpec) -> ZygoteGroup:
        module, target, args = self._command(spec.cmd)
        zygote = self._ready_zygote()
        plan = plan_output(spec)
        started = time.monotonic()
        cwd = os.getcwd()
        argv = ["-m", *args] if module else [target, *args]
        local_ranks = sorted(spec.envs)
        common = {
            "argv": argv,
            "orig_argv": list(spec.cmd),
            "module": module,
            "target": target,
            "env": dict(os.environ),  # each rank: this updated with its own, as Popen does
            "cwd": cwd,
        }
        pids: list[int] = []
        try:
            for first in range(0, len(local_ranks), MAX_RANKS_PER_REQUEST):
                chunk = local_ranks[first : first + MAX_RANKS_PER_REQUEST]
                envs = [spec.envs[local_rank] for local_rank in chunk]
                with rank_stdio(plan, chunk) as fds:
                    pids += zygote.spawn(common, envs, fds)
        except BaseException as error:
            plan.close()
            forked = pids + (error.pids if isinstance(error, ZygoteUnavailable) else [])
            for pid in forked:  # a partial group goes; the fallback starts them all
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                wait_child(pid, CLOSE_TIMEOUT_S)
            raise
        plan.close_child_ends()
        logs = plan.dest
        ranks = {
            local_rank: RankHandle(
                local_rank=local_rank,
                pid=pid,
                error_file=logs.error_files[local_rank],
                stdout=logs.stdouts[local_rank],
                stderr=logs.stderrs[local_rank],
            )
            for local_rank, pid in zip(local_ranks, pids, strict=True)
        }
        self._last_reason = None
        log.debug(
            "forked %d ranks from the zygote in %.1f ms",
            len(ranks),
            (time.monotonic() - started) * 1000,
        )
        run_id = spec.envs[0].get("TORCHELASTIC_RUN_ID", "none")
        attempt = spec.envs[0].get("TORCHELASTIC_RESTART_COUNT", "0")
        attempt_dir = os.path.join(spec.log_dir, run_id, f"attempt_{attempt}")
        return ZygoteGroup(ranks, attempt_dir, plan.streams)
