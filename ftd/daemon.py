"""The node daemon: the lifecycle owner. It builds the parts, runs the attempt loop, and takes
the parts down in reverse order, every step bounded and every error reported.

    async with Daemon(config) as daemon:
        code = await daemon.run()

Set-up, in five stages (`_set_up`): the journal (the run directory and its event log, background
work, the signal handlers); the parts, each built whole (the coordinator, made but not yet
connected; the snapshot holder with its replicas; the rank health service; the straggler watch;
the status board); the node (the orphan guard, the rank socket, the snapshots' memory, the REST
API, up while the node reaches the rendezvous); the rendezvous (hosting or joining its store,
then the replicas' server and the straggler watch); the attempts (the workers' stores, the start
method: the zygote, the supervisor). Each part registers its teardown (ftd.tasks.Teardown) as
it comes up; teardown undoes them in reverse, and the event log closes last.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import uuid
from pathlib import Path
from types import TracebackType

from ftd_client.checkpoint_messages import CHECKPOINT_KINDS

from ftd.api import ApiServer, start_api_server
from ftd.api.control import NodeControl
from ftd.checkpoint.holder import CheckpointHolder
from ftd.checkpoint.replication import replication_for
from ftd.config.rundir import prepare_run_dir
from ftd.config.serve import ServeConfig
from ftd.coordination import CoordinationError, Coordinator, create_coordinator
from ftd.coordination.job_share import JobShare
from ftd.errors import StartupError
from ftd.health.first_steps import FirstSteps
from ftd.health.inbox import by_global_rank
from ftd.health.job_times import JobTimesShare
from ftd.health.progress import ProgressWatch
from ftd.health.service import HealthService
from ftd.health.straggler_timer import StragglerTimer
from ftd.health.unix_socket import socket_path
from ftd.ranks.daemon_process import become_subreaper, raise_descriptor_limit
from ftd.ranks.guard import GuardKeeper
from ftd.ranks.launch import build_command
from ftd.ranks.spawn import Spawner, get_spawner
from ftd.ranks.spawn.rank_main import DAEMON_HANDLED_SIGNALS
from ftd.ranks.workers_store import AttemptStores, own_process
from ftd.status.board import StatusBoard
from ftd.status.event_kind import EventKind
from ftd.status.events import EventLog
from ftd.status.model import NodeStatus
from ftd.status.persist import Persistence
from ftd.supervision.attempt import AttemptTools, Running
from ftd.supervision.node_loss import NodeLoss
from ftd.supervision.supervisor import Supervisor
from ftd.tasks import Background, Teardown, first_of

log = logging.getLogger("ftd.daemon")

TEARDOWN_STEP_TIMEOUT_S = 30.0
"""A teardown step past this is logged with every thread's stack and left behind; the workers'
stop is exempt (its kill escalation bounds it)."""
SECRETS_FROM_ENV = ("FTD_API_TOKEN",)
"""Read at start-up, then taken out of this process's environment: no rank inherits them."""


class Daemon:
    """`async with Daemon(config) as daemon: code = await daemon.run()`."""

    events: EventLog
    persist: Persistence
    board: StatusBoard
    background: Background
    coordinator: Coordinator
    health: HealthService
    guard: GuardKeeper
    stores: AttemptStores
    spawner: Spawner
    supervisor: Supervisor
    control: NodeControl
    api: ApiServer | None

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.daemon_id = uuid.uuid4().hex[:12]
        log_dir = str(config.log_dir) if config.log_dir else tempfile.mkdtemp(prefix="ftd_")
        if config.multi_node:  # several daemons of one job may share a machine and a log dir
            log_dir = os.path.join(log_dir, config.node_id)
        self.log_dir = log_dir
        self.run_dir = Path(log_dir) / config.run_id
        self.status = NodeStatus(
            node_id=config.node_id,
            run_id=config.run_id,
            max_restarts=config.max_restarts,
            restart_policy=config.restart_policy,
        )
        self.stop = asyncio.Event()
        self.force = asyncio.Event()
        self.running = Running()
        self._teardown = Teardown(TEARDOWN_STEP_TIMEOUT_S)
        self._start_error: CoordinationError | None = None

    # -- set-up ------------------------------------------------------------------------------

    async def __aenter__(self) -> Daemon:
        try:
            await self._set_up()
        except BaseException as error:
            # A part that failed to start (a busy API port, say) must not leave the others.
            await self.__aexit__(type(error), error, error.__traceback__)
            raise
        return self

    async def _set_up(self) -> None:
        """The stages in the order the module's docstring states; each part registers its own
        teardown as it comes up, so a stage that fails leaves only what came up before it."""
        self._open_journal()
        stragglers, first_steps = self._build_parts()
        await self._start_node()
        await self._reach_rendezvous(stragglers)
        self._prepare_attempts(first_steps)

    def _open_journal(self) -> None:
        """The run directory and its event log, background work, the signal handlers."""
        prepare_run_dir(self.run_dir)
        journal = str(self.run_dir / "events.jsonl")
        try:
            self.events = EventLog(
                self.run_dir / "events.jsonl",
                on_failure=lambda cause, detail: self._persist_failed(journal, cause, detail),
                on_recovery=lambda lost: self._persist_recovered(journal, events_lost=lost),
            )
        except OSError as error:
            raise StartupError(
                f"cannot open {self.run_dir / 'events.jsonl'}: {error.strerror} (a link or "
                "another user's file there is refused)"
            ) from None
        self._teardown.push_now("closing the event log", self.events.close)
        self._teardown.push_now("saying the daemon stopped", self._say_stopped, first=True)
        self.persist = Persistence(self._persist_failed, self._persist_recovered)
        self.background = Background()
        self._teardown.push("finishing background work", self.background.close)
        loop = asyncio.get_running_loop()
        for sig in DAEMON_HANDLED_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        self._teardown.push_now("restoring signal handlers", self._remove_signals)

    def _build_parts(self) -> tuple[StragglerTimer, FirstSteps]:
        """The coordinator (made, not yet connected), the snapshot holder, the rank health
        service, the straggler watch and the status board, each whole; nothing runs yet."""
        config = self.config
        try:
            self.coordinator = create_coordinator(  # takes FTD_RDZV_SECRET out of env
                config, lambda kind, data: self.events.emit(kind, **data)
            )
        except CoordinationError as error:
            raise StartupError(error.reason) from None
        rank_socket = socket_path(self.run_dir, self.daemon_id)
        if rank_socket.parent != self.run_dir:  # a private mkdtemp: the run dir's path is long
            private = rank_socket.parent
            self._teardown.push(
                "removing the sockets' directory",
                lambda: asyncio.to_thread(shutil.rmtree, private, ignore_errors=True),
            )
        several = config.multi_node
        share = JobShare(self.coordinator, self._reachable)
        replication = replication_for(
            config, self.coordinator, self.events, share, self._publish_summary
        )
        self.checkpoints = CheckpointHolder.serving(config, self.run_dir, self.events, replication)
        self.progress = ProgressWatch(config.progress_timeout_floor_s, enabled=config.progress)
        first_steps = FirstSteps(self.progress.node)
        self.health = HealthService(
            config.ft,
            rank_socket,
            config.ft_state_file or self.run_dir / "ft_state.json",
            self.events,
            self.persist,
            self.progress,
            dict.fromkeys(CHECKPOINT_KINDS, by_global_rank(self.checkpoints.answer)),
            first_steps,
        )
        stragglers = StragglerTimer(
            self.progress,
            self.events,
            config.node_id,
            JobTimesShare(share) if several else None,
            self._publish_summary if several else None,
        )
        self.board = StatusBoard(
            config,
            self.status,
            self.events,
            self.persist,
            self.run_dir,
            self.health,
            self._publish if several else None,
            self.checkpoints.view,
            (stragglers.summary, self.checkpoints.replica_summary),
        )
        return stragglers, first_steps

    async def _start_node(self) -> None:
        """This node's own parts: the orphan guard, the rank socket, the snapshots' memory and
        the REST API (up while the node reaches the rendezvous; a taken port ends the start
        here, before any rank or zygote exists)."""
        config = self.config
        self.events.emit(
            EventKind.DAEMON_STARTED,
            node_id=config.node_id,
            run_id=config.run_id,
            pid=os.getpid(),
            nproc_per_node=config.nproc_per_node,
        )
        become_subreaper()
        raise_descriptor_limit()
        self.guard = await asyncio.to_thread(GuardKeeper, self.daemon_id, self._guard_restarted)
        self.guard.watch()
        self._teardown.push("closing the orphan guard", self._close_guard)
        self.health.start()
        self._teardown.push_now("closing the rank socket", self.health.close)
        await asyncio.to_thread(self.checkpoints.start)
        self._teardown.push(
            "freeing the snapshots' memory", lambda: asyncio.to_thread(self.checkpoints.close)
        )
        self.control = NodeControl(
            config,
            self.status,
            self.events,
            self.run_dir,
            self.running,
            self.coordinator,
            self.health,
            self.background,
            self.board.summary,
            self.board.snapshot,
        )
        self.api = None
        if config.api_port is not None:  # up while the node reaches the rendezvous
            self.api = await start_api_server(self.control)
            self._teardown.push("closing the API server", self.api.close)

    async def _reach_rendezvous(self, stragglers: StragglerTimer) -> None:
        """Hosting or joining the rendezvous store (a failure is kept for `run()` to leave with),
        then what needs the other nodes: the replicas' server and the straggler watch."""
        config = self.config
        node_loss = NodeLoss(config, self.coordinator, self.events, self.background, self.running)
        try:
            start = asyncio.ensure_future(
                self.coordinator.start(node_loss.on_node_lost, self.board)
            )
            if await first_of(start, self.stop.wait()) is not start:  # a signal came first
                start.cancel()
                with contextlib.suppress(BaseException):
                    await start
                raise CoordinationError("stopped while reaching the rendezvous", "stopped")
            start.result()
        except CoordinationError as error:
            self._start_error = error
        self._teardown.push("leaving the rendezvous", self.coordinator.close)
        if self._start_error is None:
            await self.checkpoints.serve_replicas(self.coordinator.address)
            self._teardown.push("closing the replicas' server", self.checkpoints.close_replicas)
        stragglers.start()
        self._teardown.push_now("closing the straggler watch", stragglers.close)

    def _prepare_attempts(self, first_steps: FirstSteps) -> None:
        """The workers' stores, the secrets out of the environment, the start method, and the
        supervisor that runs the attempts with them."""
        config = self.config
        address = self.coordinator.address if self._start_error is None else "127.0.0.1"
        self.stores = AttemptStores(address, config.master_port or 0, *own_process(config))
        self._teardown.push("closing the workers' store", self.stores.close)
        for name in SECRETS_FROM_ENV:
            os.environ.pop(name, None)
        # Without a rendezvous no rank will start: no zygote to preload torch and wait for.
        method = config.start_method if self._start_error is None else "subprocess"
        self.spawner = get_spawner(method, config.preload)
        self._teardown.push(
            "closing the start method", lambda: asyncio.to_thread(self.spawner.close)
        )
        tools = AttemptTools(
            config=config,
            run_dir=self.run_dir,
            log_dir=self.log_dir,
            daemon_id=self.daemon_id,
            cmd=build_command(config),
            spawner=self.spawner,
            health=self.health,
            progress=self.progress,
            first_steps=first_steps,
            checkpoints=self.checkpoints,
            guard=self.guard,
            events=self.events,
            status=self.status,
            board=self.board,
            coordinator=self.coordinator,
            stores=self.stores,
        )
        self.supervisor = Supervisor(
            tools, self.board, self.background, self.stop, self.force, address, self.running
        )
        if config.multi_node and self._start_error is None:
            log.info(
                "rendezvous: job %s, nodes %d:%d, %s%s",
                config.run_id,
                config.nnodes_min,
                config.nnodes_max,
                self.coordinator.describe,
                " (hosted here)" if self.coordinator.hosting else "",
            )
        log.info(
            "ftd serve: node %s, run %s, %d local ranks, max restarts %d, run dir %s",
            config.node_id,
            config.run_id,
            config.nproc_per_node,
            config.max_restarts,
            self.run_dir,
        )

    def _reachable(self) -> bool:
        """Whether the rendezvous is there to read from and write to."""
        return self._start_error is None and not self.coordinator.lost.is_set()

    def _publish_summary(self) -> None:
        self._publish(self.board.summary())

    def _publish(self, summary: dict[str, object]) -> None:
        if self._reachable():
            self.background.spawn(self._send_summary(summary), "publish-status")

    async def _send_summary(self, summary: dict[str, object]) -> None:
        with contextlib.suppress(CoordinationError):
            await self.coordinator.publish_status(summary)

    async def _close_guard(self) -> None:
        self.guard.unwatch()
        await asyncio.to_thread(self.guard.close)

    def _say_stopped(self) -> None:
        """The daemon's last word (its attempt is over, the node's state final), said while the
        API still serves it to the event stream's readers."""
        self.events.emit(EventKind.DAEMON_STOPPED, state=self.status.state.value)

    def _guard_restarted(self, old_pid: int, new_pid: int) -> None:
        self.events.emit(EventKind.GUARD_RESTARTED, old_pid=old_pid, pid=new_pid)

    def _persist_failed(self, path: str, cause: str, detail: str) -> None:
        self.events.emit(EventKind.PERSIST_FAILED, path=path, cause=cause, detail=detail)

    def _persist_recovered(self, path: str, **detail: object) -> None:
        self.events.emit(EventKind.PERSIST_RECOVERED, path=path, **detail)

    async def run(self) -> int:
        """Run attempts until success, failure or a stop signal; the process exit code."""
        if self._start_error is not None:
            return self.supervisor.leave(self._start_error)
        return await self.supervisor.run()

    def _on_signal(self, sig: signal.Signals) -> None:
        # Record only; the loop acts.
        if not self.stop.is_set():
            log.warning("received %s: stopping the workers (again to force)", sig.name)
            self.running.stop_asked(sig)
            self.stop.set()
        else:
            log.warning("received %s again: killing the workers now", sig.name)
            self.force.set()

    def _remove_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in DAEMON_HANDLED_SIGNALS:
            loop.remove_signal_handler(sig)

    # -- teardown ----------------------------------------------------------------------------

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Teardown in reverse order of set-up; every step runs, every error is reported."""
        if self.running.attempt is not None:  # not bounded here: its kill escalation bounds it
            try:
                await self.supervisor.close()
            except Exception:
                log.exception("error while stopping the workers")
        await self._teardown.run()  # the event log, the first part up, closes last
