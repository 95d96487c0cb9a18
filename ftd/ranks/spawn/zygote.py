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
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Sequence

from ftd.config.serve import NO_PRELOAD
from ftd.ranks.spawn.base import LaunchSpec, RankHandle, StartedGroup
from ftd.ranks.spawn.forked import (
    ZygoteGroup,
    describe_exit,
    is_subreaper,
    rank_stdio,
    wait_child,
)
from ftd.ranks.spawn.output import plan_output
from ftd.ranks.spawn.pcontext import PContextSpawner
from ftd.ranks.spawn.zygote_process import (
    CLOSE_TIMEOUT_S,
    DEFAULT_PRELOAD,
    WARM,
    Zygote,
    ZygoteUnavailable,
)
from ftd.ranks.spawn.zygote_server import MAX_RANKS_PER_REQUEST

log = logging.getLogger("ftd.spawn.zygote")

LISTEN_AFTER_S = 0.5
"""How often the watcher looks whether a zygote it does not listen to yet became ready."""


class ZygoteSpawner:
    name = "zygote"

    def __init__(self, preload: Sequence[str] = ()) -> None:
        self._preload = (
            ()
            if tuple(preload) == (NO_PRELOAD,)
            else tuple(dict.fromkeys((*DEFAULT_PRELOAD, *preload)))
        )
        self._warm = tuple(m for m in WARM if self._preload and m not in self._preload)
        self._fallback = PContextSpawner()
        self._lock = threading.Lock()
        self._disabled: str | None = None
        self._last_reason: str | None = None
        self._closed = False
        self._eager_restarts = 1
        self._zygote: Zygote | None = self._launch()

    def _launch(self) -> Zygote:
        zygote = Zygote(self._preload, self._warm)
        preloading = ", ".join(self._preload) or "nothing"
        log.info("zygote (pid %d) started: preloading %s", zygote.pid, preloading)
        threading.Thread(
            target=self._watch, args=(zygote,), name=f"ftd-zygote-{zygote.pid}", daemon=True
        ).start()
        return zygote

    def _watch(self, zygote: Zygote) -> None:
        """Start a new zygote as soon as this one dies, so that the next restart is warm;
        once per attempt at most (a zygote that keeps dying is started again by `start`).
        Meanwhile, hear what it says unasked (its warming) when it says it."""
        with contextlib.suppress(ProcessLookupError):
            fd = os.pidfd_open(zygote.pid)
            try:
                while not self._died_or_heard(fd, zygote):
                    pass
            finally:
                os.close(fd)
        with self._lock:
            if self._closed or zygote is not self._zygote or not self._eager_restarts:
                return
            self._eager_restarts -= 1
            self._zygote = self._replace_dead(zygote)

    def _died_or_heard(self, pidfd: int, zygote: Zygote) -> bool:
        """Wait for the zygote's death (True) or a word from it (False, taken in)."""
        listening = zygote.ready and not zygote.closed  # the readiness is wait_ready's to read
        watched = [pidfd, zygote.fileno] if listening else [pidfd]
        try:
            readable = select.select(watched, [], [], None if listening else LISTEN_AFTER_S)[0]
        except OSError:  # its socket was closed meanwhile: watch its death alone
            return False
        if pidfd in readable:
            return True
        if not readable:
            return False
        with self._lock:  # a request in flight reads its own reply first
            if zygote is self._zygote:
                zygote.read_unasked()
            else:  # replaced or closed: its socket is nobody's to read
                return zygote.closed or not zygote.alive()
        return False

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
