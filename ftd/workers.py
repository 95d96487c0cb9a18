"""One attempt of the node's worker group: exits noticed the moment they happen, bounded stop.

A rank's exit is seen through a pidfd registered with the event loop (no polling loop): the
pidfd turns readable when the process exits, and the callback reaps it without blocking.
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

from ftd.guard import kill_tagged
from ftd.spawn import LaunchSpec, Spawner, StartedGroup
from ftd.state import Failure, RankState, RankStatus, describe_exit

log = logging.getLogger("ftd.workers")

SPAWN_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 10.0
SIGKILL_WAIT_S = 5.0

ExitListener = Callable[[RankStatus], object]


class WorkerGroup:
    """Owns one attempt's processes; the daemon owns the attempt sequence."""

    def __init__(
        self,
        started: StartedGroup,
        statuses: dict[int, RankStatus],
        on_register: Callable[[int], None],
        on_unregister: Callable[[int], None],
        daemon_id: str,
    ) -> None:
        self._started = started
        self.statuses = statuses
        self._on_unregister = on_unregister
        self._daemon_id = daemon_id
        self._loop = asyncio.get_running_loop()
        self._exited: dict[int, asyncio.Future[int]] = {}
        self._pidfds: dict[int, int] = {}
        self._outcome: asyncio.Future[Failure | None] = self._loop.create_future()
        self._stopping = False
        self.exit_listeners: list[ExitListener] = []
        now = time.time()
        for local_rank, handle in started.ranks.items():
            on_register(handle.pid)
            status = statuses[local_rank]
            status.pid, status.state, status.started_at = handle.pid, RankState.RUNNING, now
            self._exited[local_rank] = self._loop.create_future()
            fd = os.pidfd_open(handle.pid)
            self._pidfds[local_rank] = fd
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
    ) -> WorkerGroup:
        started = await asyncio.wait_for(
            asyncio.to_thread(spawner.start, spec), timeout=SPAWN_TIMEOUT_S
        )
        return cls(started, statuses, on_register, on_unregister, daemon_id)

    @property
    def attempt_log_dir(self) -> str:
        return self._started.attempt_log_dir

    @property
    def error_files(self) -> dict[int, str]:
        return {lr: handle.error_file for lr, handle in self._started.ranks.items()}

    @property
    def pids(self) -> dict[int, int]:
        return {lr: handle.pid for lr, handle in self._started.ranks.items()}

    def _on_pidfd_readable(self, local_rank: int) -> None:
        code = self._started.reap(local_rank)
        if code is None:
            return
        fd = self._pidfds.pop(local_rank)
        self._loop.remove_reader(fd)
        os.close(fd)
        status = self.statuses[local_rank]
        status.exit_code, status.ended_at = code, time.time()
        if self._stopping:
            status.state = RankState.STOPPED if code != 0 else RankState.SUCCEEDED
        else:
            status.state = RankState.SUCCEEDED if code == 0 else RankState.FAILED
        log.debug("local rank %d (pid %d) exited: %s", local_rank, status.pid, describe_exit(code))
        self._exited[local_rank].set_result(code)
        for listener in self.exit_listeners:
            listener(status)
        if self._outcome.done():
            return
        if code != 0 and not self._stopping:
            handle = self._started.ranks[local_rank]
            kind = "signal" if code < 0 else "exit"
            self._outcome.set_result(
                Failure(
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
            )
        elif all(f.done() and f.result() == 0 for f in self._exited.values()):
            self._outcome.set_result(None)

    async def wait(self) -> Failure | None:
        """The attempt's outcome: None when every rank exited 0, else the first failure."""
        return await asyncio.shield(self._outcome)

    def signal_rank(self, local_rank: int, sig: signal.Signals) -> None:
        self._started.kill(local_rank, sig)

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
            self._started.kill(local_rank, sig)
        if pending and not await self._wait_exited(pending, grace_s, force):
            stubborn = [lr for lr in pending if not self._exited[lr].done()]
            log.warning(
                "local ranks %s did not exit %.1fs after %s; sending SIGKILL",
                stubborn,
                grace_s,
                sig.name,
            )
            for local_rank in stubborn:
                self._started.kill(local_rank, signal.SIGKILL)
            if not await self._wait_exited(stubborn, SIGKILL_WAIT_S):
                log.error("local ranks %s survived SIGKILL (uninterruptible sleep?)", stubborn)
        for local_rank in self._exited:
            self._started.kill(local_rank, signal.SIGKILL)
        await asyncio.to_thread(self._sweep_strays)
        await asyncio.wait_for(asyncio.to_thread(self._started.close), CLOSE_TIMEOUT_S)
        for handle in self._started.ranks.values():
            self._on_unregister(handle.pid)
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
        for pid in kill_tagged(self._daemon_id, skip=frozenset(self.pids.values())):
            log.warning("killed stray process %d left by a rank", pid)
            with contextlib.suppress(ChildProcessError):  # not our child: its parent reaps it
                os.waitpid(pid, 0)
