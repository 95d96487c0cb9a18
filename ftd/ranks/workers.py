"""One attempt of the node's worker group: exits noticed the moment they happen, bounded stop.

A rank's exit is seen through a pidfd registered with the event loop (no polling loop): the
pidfd turns readable when the process exits, and the callback reaps it without blocking.

Under `--restart-mode inprocess` a failed rank does not end the attempt: its failure goes to
`failure_handler`, which may start a new process in its place (`respawn`) or give it up (`drop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from ftd.ranks.guard import kill_tagged
from ftd.ranks.output import OutputDrain
from ftd.ranks.spawn import LaunchSpec, RankHandle, Spawner, StartedGroup
from ftd.status.board import StatusBoard
from ftd.status.model import Failure, RankStatus, describe_exit
from ftd.tasks import within

log = logging.getLogger("ftd.workers")

SPAWN_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 10.0
SIGKILL_WAIT_S = 5.0

ExitListener = Callable[[RankStatus], object]
FailureHandler = Callable[[Failure], object]


def _one_rank_std(value: str, local_rank: int) -> str:
    """A --redirects/--tee value for a spec whose only rank (0) is `local_rank`."""
    from ftd.config.serve import parse_std

    parsed = parse_std(value)
    return value if isinstance(parsed, int) else str(parsed.get(local_rank, 0))


class WorkerGroup:
    """Owns one attempt's processes; the daemon owns the attempt sequence."""

    def __init__(
        self,
        started: StartedGroup,
        statuses: dict[int, RankStatus],
        on_register: Callable[[int], None],
        on_unregister: Callable[[int], None],
        daemon_id: str,
        spawner: Spawner | None = None,
        spec: LaunchSpec | None = None,
        output: OutputDrain | None = None,
        *,
        failure_handler: FailureHandler | None = None,
        on_exit: ExitListener | None = None,
    ) -> None:
        self._started = started
        self.statuses = statuses
        self._on_register = on_register
        self._on_unregister = on_unregister
        self._daemon_id = daemon_id
        self._spawner = spawner
        self._spec = spec
        self._loop = asyncio.get_running_loop()
        self._procs: dict[int, tuple[StartedGroup, int]] = {}
        """Each local rank's current process: the started group holding it and its index there
        (a respawned rank is index 0 of a group of its own)."""
        self._all_started: list[StartedGroup] = [started]
        self._all_pids: list[int] = []
        self._exited: dict[int, asyncio.Future[int]] = {}
        self._pidfds: dict[int, int] = {}
        """Each local rank's current process, as a pidfd; every pidfd is closed at stop."""
        self._all_pidfds: list[int] = []
        self._outcome: asyncio.Future[Failure | None] = self._loop.create_future()
        self._stopping = False
        self._dropped: set[int] = set()
        self._last_failure: Failure | None = None
        self.respawns: dict[int, int] = {}
        self.on_exit = on_exit
        self.failure_handler = failure_handler
        self._verdict: Failure | None = None
        """When given, a failed rank is handed to it and the attempt goes on (in-process mode)."""
        self.output = output if output is not None else OutputDrain(0)
        self.output.attach(started.streams)
        for local_rank in started.ranks:
            self._track(local_rank, started, local_rank)

    def _track(self, local_rank: int, started: StartedGroup, index: int) -> None:
        handle = started.ranks[index]
        self._procs[local_rank] = (started, index)
        self._all_pids.append(handle.pid)
        self._on_register(handle.pid)
        status = self.statuses[local_rank]
        StatusBoard.rank_started(status, handle.pid)
        self._exited[local_rank] = self._loop.create_future()
        fd = os.pidfd_open(handle.pid)
        self._pidfds[local_rank] = fd
        self._all_pidfds.append(fd)
        self._loop.add_reader(fd, self._on_pidfd_readable, local_rank)
        # The rank may have exited before its pidfd was registered: readable at once then.

    @classmethod
    async def start(
        cls,
        spawner: Spawner,
        spec: LaunchSpec,
        statuses: dict[int, RankStatus],
        on_register: Callable[[int], None],
        on_unregister: Callable[[int], None],
        daemon_id: str,
        output: OutputDrain | None = None,
        *,
        failure_handler: FailureHandler | None = None,
        on_exit: ExitListener | None = None,
    ) -> WorkerGroup:
        started = await within(asyncio.to_thread(spawner.start, spec), SPAWN_TIMEOUT_S)
        return cls(
            started,
            statuses,
            on_register,
            on_unregister,
            daemon_id,
            spawner,
            spec,
            output,
            failure_handler=failure_handler,
            on_exit=on_exit,
        )

    @property
    def attempt_log_dir(self) -> str:
        return self._started.attempt_log_dir

    def _handle(self, local_rank: int) -> RankHandle:
        started, index = self._procs[local_rank]
        return started.ranks[index]

    @property
    def error_files(self) -> dict[int, str]:
        return {lr: self._handle(lr).error_file for lr in self._procs}

    @property
    def pids(self) -> dict[int, int]:
        return {lr: self._handle(lr).pid for lr in self._procs}

    def _on_pidfd_readable(self, local_rank: int) -> None:
        started, index = self._procs[local_rank]
        fd = self._pidfds[local_rank]
        code = _exit_status(fd)
        if code is None:
            code = started.reap(index)  # only if someone else waited for it
            if code is None:
                return
        self._loop.remove_reader(fd)
        status = self.statuses[local_rank]
        StatusBoard.rank_exited(status, code, stopped=self._stopping)
        log.debug("local rank %d (pid %d) exited: %s", local_rank, status.pid, describe_exit(code))
        self._exited[local_rank].set_result(code)
        try:
            self._resolve(local_rank, status, code)
        finally:  # a listener that fails (a full disk under the event log) loses nothing
            if self.on_exit is not None:
                try:
                    self.on_exit(status)
                except Exception:
                    log.exception("the exit listener failed for local rank %d", local_rank)

    def _resolve(self, local_rank: int, status: RankStatus, code: int) -> None:
        """A rank's exit decides the attempt's outcome (the first failure, or every rank 0)."""
        if self._outcome.done():
            return
        if code != 0 and not self._stopping and self._verdict is not None:
            self._outcome.set_result(self._verdict)  # it died while being explained (stacks)
        elif code != 0 and not self._stopping:
            handle = self._handle(local_rank)
            kind = "signal" if code < 0 else "exit"
            failure = Failure(
                kind=kind,
                reason=f"rank {status.global_rank} (local {local_rank}, pid {handle.pid}) "
                f"failed with {describe_exit(code)}",
                local_rank=local_rank,
                global_rank=status.global_rank,
                pid=handle.pid,
                exit_code=code,
                error_file=handle.error_file,
                timestamp=status.ended_at or time.time(),
            )
            if self.failure_handler is None:
                self._outcome.set_result(failure)
            else:
                self._last_failure = failure
                self.failure_handler(failure)
        else:
            self._check_all_done()

    def _check_all_done(self) -> None:
        """Every rank exited, each with 0 unless it was dropped: the attempt is over."""
        futures = self._exited
        if self._outcome.done() or not all(f.done() for f in futures.values()):
            return
        succeeded = all(lr in self._dropped or f.result() == 0 for lr, f in futures.items())
        if succeeded and len(self._dropped) < len(futures):
            self._outcome.set_result(None)
        else:
            self._outcome.set_result(self._last_failure)

    def drop(self, local_rank: int) -> None:
        """In-process mode: the failed rank is given up; the others go on without it."""
        self._dropped.add(local_rank)
        self._check_all_done()

    async def respawn(self, local_rank: int, env: dict[str, str]) -> int:
        """In-process mode: start a new process for a rank whose process exited; its pid.

        The process gets the rank's environment updated with `env`; its logs go to
        `<attempt dir>/<local rank>.respawn_<n>/` under the usual layout.
        """
        assert self._spawner is not None and self._spec is not None
        assert self._exited[local_rank].done(), "only an exited rank is respawned"
        spec = self._spec
        number = self.respawns[local_rank] = self.respawns.get(local_rank, 0) + 1
        prefixes = spec.log_line_prefixes
        one = LaunchSpec(
            name=spec.name,
            cmd=spec.cmd,
            envs={0: {**spec.envs[local_rank], **env}},
            log_dir=os.path.join(self.attempt_log_dir, f"{local_rank}.respawn_{number}"),
            redirects=_one_rank_std(spec.redirects, local_rank),
            tee=_one_rank_std(spec.tee, local_rank),
            # A filter naming no rank of this one-rank group hides its output.
            local_ranks_filter=(
                None
                if spec.local_ranks_filter is None or local_rank in spec.local_ranks_filter
                else frozenset({1})
            ),
            log_line_prefixes={0: prefixes[local_rank]} if prefixes else None,
            python=spec.python,
        )
        started = await within(asyncio.to_thread(self._spawner.start, one), SPAWN_TIMEOUT_S)
        self._all_started.append(started)
        self.output.attach(started.streams)
        if self._stopping:  # stopped while it started: it goes with the others
            started.kill(0, signal.SIGKILL)
        self._track(local_rank, started, 0)
        pid: int = started.ranks[0].pid
        log.info("local rank %d respawned as pid %d", local_rank, pid)
        return pid

    async def wait(self) -> Failure | None:
        """The attempt's outcome: None when every rank exited 0, else the first failure."""
        return await asyncio.shield(self._outcome)

    def signal_rank(self, local_rank: int, sig: signal.Signals) -> None:
        """`sig` to the rank's process group. Safe from pid reuse: the rank is reaped only when
        the group stops, so its pid (the group's id) cannot name another process before."""
        if not self._all_pidfds:
            return  # stopped and reaped
        started, index = self._procs[local_rank]
        started.kill(index, sig)

    def signal_process(self, local_rank: int, pid: int, sig: int) -> bool:
        """`sig` to the rank's process alone, through its pidfd, if `pid` is still its current
        process and running (a stack dump, an injected fault); whether it was sent."""
        fd = self._pidfds.get(local_rank)
        if fd is None or self.pids.get(local_rank) != pid or self._exited[local_rank].done():
            return False
        try:
            signal.pidfd_send_signal(fd, sig)
        except ProcessLookupError:
            return False
        return True

    def judged(self, verdict: Failure) -> None:
        """A hang verdict is being carried out (stacks first): a rank's failing exit meanwhile
        ends the attempt with it, not as a crash of its own (health/hangs.py)."""
        self._verdict = verdict

    def fail(self, failure: Failure) -> None:
        """Another part of the daemon (monitor, API) ends the attempt with this failure."""
        if not self._outcome.done():
            self._outcome.set_result(failure)

    async def stop(
        self,
        sig: signal.Signals = signal.SIGTERM,
        grace_s: float = 5.0,
        force: asyncio.Event | None = None,
    ) -> None:
        """Bounded escalation: `sig` to every rank's process group, grace, then SIGKILL.

        Process groups are signalled even after their leader exited, so a rank's children go
        with it; descendants that left the group (new sessions) are swept by their env token.
        """
        self._stopping = True
        pending = [lr for lr, fut in self._exited.items() if not fut.done()]
        for local_rank in pending:
            log.info("sending %s to local rank %d", sig.name, local_rank)
            self.signal_rank(local_rank, sig)
        if pending and not await self._wait_exited(pending, grace_s, force):
            stubborn = [lr for lr in pending if not self._exited[lr].done()]
            log.warning(
                "local ranks %s did not exit %.1fs after %s; sending SIGKILL",
                stubborn,
                grace_s,
                sig.name,
            )
            for local_rank in stubborn:
                self.signal_rank(local_rank, signal.SIGKILL)
            if not await self._wait_exited(stubborn, SIGKILL_WAIT_S):
                log.error("local ranks %s survived SIGKILL (uninterruptible sleep?)", stubborn)
        for started in self._all_started:
            for index in started.ranks:
                started.kill(index, signal.SIGKILL)
        await asyncio.to_thread(self._sweep_strays)
        # Only now are the ranks reaped: until here each exited rank stayed a zombie, so its
        # pid, and the process group named by it, could not be given to another process.
        for started in self._all_started:
            for index in started.ranks:
                started.reap(index)
        for fd in self._all_pidfds:
            with contextlib.suppress(OSError):
                self._loop.remove_reader(fd)
            os.close(fd)
        self._all_pidfds = []
        await self.output.close()  # every writer is gone: the pipes hold the last of it
        for started in self._all_started:
            await within(asyncio.to_thread(started.close), CLOSE_TIMEOUT_S)
        for pid in self._all_pids:
            self._on_unregister(pid)
        if not self._outcome.done():
            self._outcome.set_result(None)

    async def _wait_exited(
        self, local_ranks: list[int], timeout_s: float, force: asyncio.Event | None = None
    ) -> bool:
        """Whether every rank exited within the timeout (cut short when `force` is set)."""
        remaining: set[asyncio.Future[Any]] = {self._exited[lr] for lr in local_ranks}
        force_waiter = asyncio.ensure_future(force.wait()) if force is not None else None
        deadline = self._loop.time() + timeout_s
        try:
            while remaining:
                waiters = remaining | ({force_waiter} if force_waiter else set())
                timeout = deadline - self._loop.time()
                if timeout <= 0:
                    break
                done, _ = await asyncio.wait(
                    waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if force_waiter is not None and force_waiter.done():
                    break
                remaining -= done
        finally:
            if force_waiter is not None:
                force_waiter.cancel()
        return all(self._exited[lr].done() for lr in local_ranks)

    def _sweep_strays(self) -> None:
        """SIGKILL descendants that escaped their rank's process group (found by this daemon's
        FTD_DAEMON_ID in their environment); reap those re-parented to us, the subreaper."""
        for pid in kill_tagged(self._daemon_id, skip=frozenset(self._all_pids)):
            log.warning("killed stray process %d left by a rank", pid)
            with contextlib.suppress(ChildProcessError):  # not our child: its parent reaps it
                os.waitpid(pid, 0)


def _exit_status(pidfd: int) -> int | None:
    """The exit status of the process behind `pidfd`, without reaping it (Popen's convention:
    the exit code, or minus the signal number); None while it runs."""
    try:
        info = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOWAIT | os.WNOHANG)
    except ChildProcessError:
        return None
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
