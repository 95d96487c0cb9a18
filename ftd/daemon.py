"""The node daemon: one lifecycle owner for the store, the guard and the attempts."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import random
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from ftd_client import faults
from ftd_client.inprocess.keys import prefix_for
from ftd_client.protocol import WorkloadAction

from ftd.api import ApiServer, start_api_server
from ftd.config import ServeConfig
from ftd.errors import Conflict, FeatureUnavailable, Forbidden, NotFound
from ftd.events import Event, EventLog
from ftd.ft_config import parse_simulated_fault
from ftd.guard import OrphanGuard
from ftd.health import HealthService
from ftd.inprocess import InprocessRounds, rank_env
from ftd.ipc import socket_path
from ftd.launch import Placement, build_command, worker_envs
from ftd.policy import Action, after_attempt
from ftd.rendezvous import ClusterRequest, Rendezvous, RendezvousError, Round
from ftd.spawn import LaunchSpec, get_spawner
from ftd.spawn.rank_main import DAEMON_HANDLED_SIGNALS
from ftd.state import DaemonState, Failure, NodeStatus, RankState, RankStatus
from ftd.store import AttemptStores, host_tcp_store
from ftd.summary import failure_summary
from ftd.workers import WorkerGroup

log = logging.getLogger("ftd.daemon")

PR_SET_CHILD_SUBREAPER = 36
TEARDOWN_STEP_TIMEOUT_S = 30.0
"""A teardown step past this is logged with every thread's stack and left behind; the workers'
stop is exempt (its kill escalation bounds it)."""


def _become_subreaper() -> None:
    """Orphaned descendants of ranks are re-parented to the daemon, so it can sweep them."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_CHILD_SUBREAPER) failed: errno %d", ctypes.get_errno())


class Daemon:
    """`async with Daemon(config) as daemon: code = await daemon.run()`."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.daemon_id = uuid.uuid4().hex[:12]
        log_dir = str(config.log_dir) if config.log_dir else tempfile.mkdtemp(prefix="ftd_")
        if config.multi_node:  # several daemons of one job may share a machine and a log dir
            log_dir = os.path.join(log_dir, config.node_id)
        self.log_dir = log_dir
        self.run_dir = Path(log_dir) / config.run_id
        self.status = NodeStatus(
            node_id=config.node_id, run_id=config.run_id, max_restarts=config.max_restarts
        )
        self._spawner = get_spawner(config.start_method, config.preload)
        self._cmd = build_command(config)
        self._rdzv = Rendezvous(config, self._on_node_dead) if config.multi_node else None
        store_host = self._rdzv.addr if self._rdzv else config.master_addr or "127.0.0.1"
        self._stores = AttemptStores(store_host, config.master_port or 0)
        self._store_host = store_host
        self._coordination: Any = None
        """Single node, --restart-mode inprocess: the store the ranks' rounds meet in."""
        self._rounds: InprocessRounds | None = None
        self._restarts_used = 0
        """Single node: restarts counted against --max-restarts (multi-node: in the store)."""
        self._background: set[asyncio.Task[Any]] = set()
        self._guard: OrphanGuard | None = None
        self._group: WorkerGroup | None = None
        self._stop_signal: signal.Signals | None = None
        self._stop_requested = asyncio.Event()
        self._force = asyncio.Event()
        self.events = EventLog(None)
        self._api: ApiServer | None = None
        self.health: HealthService | None = None

    async def __aenter__(self) -> Daemon:
        try:
            return await self._set_up()
        except BaseException as error:
            # A part that failed to start (a busy API port, say) must not leave the others.
            await self.__aexit__(type(error), error, error.__traceback__)
            raise

    async def _set_up(self) -> Daemon:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.events = EventLog(self.run_dir / "events.jsonl")
        _become_subreaper()
        self._guard = await asyncio.to_thread(OrphanGuard, self.daemon_id)
        self.health = HealthService(
            self.config.ft,
            socket_path(self.run_dir, self.daemon_id),
            self.config.ft_state_file or self.run_dir / "ft_state.json",
            self.events,
        )
        self.health.start()
        self.status.timeouts = self.health.timeouts.model_dump()
        loop = asyncio.get_running_loop()
        for sig in DAEMON_HANDLED_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        self.events.emit(
            "daemon_started",
            node_id=self.config.node_id,
            run_id=self.config.run_id,
            pid=os.getpid(),
            nproc_per_node=self.config.nproc_per_node,
        )
        if self.config.api_port is not None:
            self._api = await start_api_server(self)
        if self._rdzv is not None:
            await self._start_rendezvous(self._rdzv)
        elif self.config.restart_mode == "inprocess":
            self._coordination = await asyncio.wait_for(
                asyncio.to_thread(host_tcp_store, self._store_host, 0), 60
            )
        log.info(
            "ftd serve: node %s, run %s, %d local ranks, max restarts %d, run dir %s",
            self.config.node_id,
            self.config.run_id,
            self.config.nproc_per_node,
            self.config.max_restarts,
            self.run_dir,
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Teardown in reverse order of set-up; every step runs, every error is reported.
        group, guard, api, health = self._group, self._guard, self._api, self.health
        rdzv = self._rdzv
        steps: list[tuple[str, Callable[[], Awaitable[object]]]] = []
        if rdzv is not None:
            steps.append(("leaving the rendezvous", rdzv.close))
        if health is not None:
            steps.append(("closing the rank socket", lambda: _run_sync(health.close)))
        steps.append(("closing the start method", lambda: asyncio.to_thread(self._spawner.close)))
        steps.append(("closing the workers' store", self._stores.close))
        coordination, self._coordination = [self._coordination], None
        steps.append(
            ("closing the in-process store", lambda: asyncio.to_thread(coordination.clear))
        )
        if api is not None:
            steps.append(("closing the API server", api.close))
        if guard is not None:
            steps.append(("closing the orphan guard", lambda: asyncio.to_thread(guard.close)))
        if group is not None:  # not bounded here: its kill escalation bounds it
            try:
                await self._stop_group(group)
            except Exception:
                log.exception("error while stopping the workers")
        for what, step in steps:
            try:
                await asyncio.wait_for(step(), TEARDOWN_STEP_TIMEOUT_S)
            except TimeoutError:
                log.error(
                    "teardown gave up %s after %.0f s; threads:\n%s",
                    what,
                    TEARDOWN_STEP_TIMEOUT_S,
                    _thread_stacks(),
                )
            except Exception:
                log.exception("error while %s", what)
        loop = asyncio.get_running_loop()
        for sig in DAEMON_HANDLED_SIGNALS:
            loop.remove_signal_handler(sig)
        self.events.emit("daemon_stopped", state=self.status.state.value)
        self.events.close()

    def _on_signal(self, sig: signal.Signals) -> None:
        # Record only; the run loop acts.
        if self._stop_signal is None:
            log.warning("received %s: stopping the workers (again to force)", sig.name)
            self._stop_signal = sig
            self._stop_requested.set()
        else:
            log.warning("received %s again: killing the workers now", sig.name)
            self._force.set()

    # -- requests from the API and other front ends (DaemonControl) --------------------------

    def request_restart(self, scope: str, reason: str, requested_by: str, count: bool) -> Event:
        group = self._group
        if self.status.state.is_terminal or self.status.state is DaemonState.STOPPING:
            raise Conflict(f"the daemon is {self.status.state}: there is nothing to restart")
        if group is None or self.status.state is not DaemonState.RUNNING:
            raise Conflict(f"the daemon is {self.status.state}; retry once it is running")
        event = self.events.emit(
            "restart_requested", scope=scope, reason=reason, by=requested_by, counted=count
        )
        group.fail(
            Failure(
                kind="request",
                reason=f"restart requested by {requested_by}: {reason}",
                timestamp=event.time,
                counted=count,
            )
        )
        return event

    def inject_fault(self, kind: str, rank: int | None, delay_s: float, requested_by: str) -> Event:
        if not self.config.enable_fault_injection:
            raise Forbidden("fault injection is off: start ftd serve with --enable-fault-injection")
        group = self._group
        if group is None or self.status.state is not DaemonState.RUNNING:
            raise Conflict(f"the daemon is {self.status.state}; faults go to running ranks")
        by_global = {status.global_rank: status for status in self.status.ranks}
        if rank is None:
            rank = random.choice(sorted(by_global))
        target = by_global.get(rank)
        if target is None or target.pid is None:
            raise NotFound(f"rank {rank} does not run on node {self.config.node_id}")
        event = self.events.emit(
            "fault_requested", kind=kind, global_rank=rank, delay_s=delay_s, by=requested_by
        )
        signal_number = faults.KILL_SIGNAL if kind == "kill" else faults.HANG_SIGNAL
        assert signal_number is not None
        asyncio.get_running_loop().call_later(
            delay_s, _deliver_fault, group, target.local_rank, target.pid, signal_number
        )
        return event

    def cluster(self) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        if self._rdzv is not None and not self._rdzv.lost.is_set():
            return self._rdzv.cluster()
        return {
            "nodes": [self.status.to_dict()],
            "round": {"round": self.status.attempt, "members": [self.config.node_id]},
            "excluded": [],
        }

    def get_timeouts(self) -> dict[str, Any]:
        assert self.health is not None
        return self.health.timeouts.model_dump()

    def set_timeouts(self, patch: dict[str, Any], requested_by: str) -> dict[str, Any]:
        assert self.health is not None
        timeouts = self.health.update(patch, by=requested_by).model_dump()
        self.status.timeouts = timeouts
        self._write_status()
        return timeouts

    def exclude_node(self, node_id: str, reason: str, requested_by: str) -> Event:
        rdzv = self._rdzv
        if rdzv is None:
            if node_id != self.config.node_id:
                raise NotFound(f"no node {node_id!r} in this job")
            raise FeatureUnavailable(
                "node exclusion needs the multi-node rendezvous: start ftd serve with "
                "--nnodes MIN:MAX (MAX > 1)"
            )
        rnd = rdzv.round
        members = rnd.node_ids if rnd else [self.config.node_id]
        if node_id not in members:
            raise NotFound(f"no node {node_id!r} in the current round ({', '.join(members)})")
        if node_id in rdzv.excluded:
            raise Conflict(f"node {node_id!r} is already excluded")
        if len(members) - 1 < self.config.nnodes_min:
            raise Conflict(
                f"excluding {node_id!r} would leave {len(members) - 1} nodes, below the minimum "
                f"of {self.config.nnodes_min}"
            )
        event = self.events.emit("node_excluded", node_id=node_id, reason=reason, by=requested_by)
        why = f"node {node_id} excluded by {requested_by}" + (f": {reason}" if reason else "")
        self._spawn(self._exclude(node_id, why, rnd))
        return event

    async def _exclude(self, node_id: str, why: str, rnd: Round | None) -> None:
        rdzv = self._rdzv
        assert rdzv is not None
        await rdzv.exclude(node_id, why)
        if rnd is not None:
            request = ClusterRequest("restart", why, self.config.node_id, nonce=uuid.uuid4().hex)
            await rdzv.request(rnd.number, request)

    def readmit_node(self, node_id: str, requested_by: str) -> Event:
        rdzv = self._rdzv
        if rdzv is None or node_id not in rdzv.excluded:
            raise NotFound(f"node {node_id!r} is not excluded")
        rdzv.excluded.pop(node_id)
        event = self.events.emit("node_readmitted", node_id=node_id, by=requested_by)
        self._spawn(rdzv.readmit(node_id))
        return event

    def _spawn(self, coro: Awaitable[Any]) -> None:
        async def run() -> None:
            try:
                await coro
            except RendezvousError as error:
                log.error("%s", error.reason)

        task = asyncio.create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _set_state(self, state: DaemonState, reason: str = "") -> None:
        if state is not self.status.state:
            log.info("state %s -> %s%s", self.status.state, state, f": {reason}" if reason else "")
            self.events.emit(
                "state_changed", previous=self.status.state.value, state=state.value, reason=reason
            )
            self.status.state = state
            if self._rdzv is not None and not self._rdzv.lost.is_set():
                self._spawn(self._rdzv.publish_status(self._summary()))
        self._write_status()

    def _summary(self) -> dict[str, Any]:
        """What this node publishes to the store for GET /v1/cluster on any node."""
        rnd = self._rdzv.round if self._rdzv else None
        failure = self.status.last_failure
        return {
            "node_id": self.config.node_id,
            "state": self.status.state.value,
            "attempt": self.status.attempt,
            "restart_count": self.status.restart_count,
            "group_rank": rnd.group_rank if rnd else None,
            "nproc_per_node": self.config.nproc_per_node,
            "last_failure": failure.reason if failure else None,
            "time": time.time(),
        }

    def _write_status(self) -> None:
        if self.health is not None:
            self.status.timeouts = self.health.timeouts.model_dump()
            server = self.health.server
            self.status.ipc = {"received": server.received, "dropped": dict(server.dropped)}
        path = self.run_dir / "status.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.status.to_dict()))
        tmp.replace(path)

    async def run(self) -> int:
        """Run attempts until success, failure or a stop signal; the process exit code."""
        if self._rdzv is not None:
            return await self._run_multi(self._rdzv)
        attempt = 0  # every attempt, counted or not: TORCHELASTIC_RESTART_COUNT
        while True:
            if self._stop_requested.is_set():
                return self._stopped()
            self._set_state(DaemonState.RENDEZVOUS)
            placement = await self._rendezvous()
            group = await self._start_attempt(placement, attempt)
            self._set_state(DaemonState.RUNNING)
            outcome_task = asyncio.ensure_future(group.wait())
            stop_task = asyncio.ensure_future(self._stop_requested.wait())
            await asyncio.wait({outcome_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
            stop_task.cancel()
            if self._stop_requested.is_set() and not outcome_task.done():
                outcome_task.cancel()
                self._set_state(DaemonState.STOPPING)
                await self._stop_group(group)
                return self._stopped()
            outcome = outcome_task.result()
            health = self.health
            assert health is not None
            health.detach()
            if self.config.ft.calc_timeouts:
                health.learn(by="ftd (calc_timeouts)")
            request = health.workload_request
            decision = after_attempt(
                outcome,
                self._restarts_used,
                self.config.max_restarts,
                request.reason() if request else None,
            )
            if outcome is not None:
                self.status.last_failure = outcome
                self.events.emit("attempt_failed", attempt=attempt, failure=outcome.to_dict())
            if decision.action is Action.RESTART:
                self._set_state(DaemonState.RESTARTING, decision.reason)
                await self._stop_group(group)
                attempt += 1
                if outcome is None or outcome.counted:
                    self._restarts_used += 1
                self.status.restart_count = self._restarts_used
                continue
            await self._stop_group(group)
            if decision.action is Action.SUCCEED:
                self._set_state(DaemonState.SUCCEEDED, decision.reason)
                return 0
            assert outcome is not None
            self._set_state(DaemonState.FAILED, decision.reason)
            self._print_summary(outcome, group)
            return 1

    # -- multi-node (ftd/rendezvous.py owns membership; this loop applies its rounds) ---------

    async def _start_rendezvous(self, rdzv: Rendezvous) -> None:
        try:
            await rdzv.start()
        except RendezvousError as error:
            self._rdzv_error: RendezvousError | None = error
            return
        self._rdzv_error = None
        log.info(
            "rendezvous: job %s, nodes %d:%d, store %s:%d%s",
            self.config.run_id,
            self.config.nnodes_min,
            self.config.nnodes_max,
            *rdzv.endpoint,
            " (hosted here)" if rdzv.hosting else "",
        )

    def _on_node_dead(self, node_id: str, reason: str) -> None:
        self.events.emit("node_lost", node_id=node_id, reason=reason)
        self._spawn(self._node_dead(node_id, reason))

    async def _node_dead(self, node_id: str, reason: str) -> None:
        rdzv = self._rdzv
        assert rdzv is not None
        rnd = rdzv.round
        if rnd is None:
            return
        if self.config.restart_policy == "min-healthy":
            healthy = await rdzv.unhealthy(rnd)
            if healthy >= self.config.nnodes_min:
                log.warning("%s; %d healthy nodes left: no restart (min-healthy)", reason, healthy)
                return
        await rdzv.request(rnd.number, self._cluster_request("restart", reason, counted=False))

    def _cluster_request(self, action: str, reason: str, counted: bool) -> ClusterRequest:
        return ClusterRequest(action, reason, self.config.node_id, counted, uuid.uuid4().hex)

    async def _first(self, *awaitables: Awaitable[Any]) -> asyncio.Future[Any]:
        """The first of `awaitables` to finish; coroutines left unfinished are cancelled,
        futures passed in are left to their owners."""
        futures = [asyncio.ensure_future(a) for a in awaitables]
        done, _ = await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
        for given, future in zip(awaitables, futures, strict=True):
            if future not in done and not isinstance(given, asyncio.Future):
                future.cancel()
        return next(f for f in futures if f in done)

    def _write_cluster_state(self, rdzv: Rendezvous) -> None:
        """`<run dir>/cluster.json`: the last round and the excluded nodes as this node saw them."""
        rnd = rdzv.round
        state = {
            "round": rnd.number if rnd else None,
            "members": rnd.node_ids if rnd else [],
            "excluded": rdzv.excluded,
        }
        path = self.run_dir / "cluster.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(path)

    def _left(self, error: RendezvousError) -> int:
        """This node leaves the job for `error.reason`: the process exit code."""
        if error.code == "stopped":
            return self._stopped()
        if error.code == "succeed":
            self._set_state(DaemonState.SUCCEEDED, error.reason)
            return 0
        state = DaemonState.STOPPED if error.code == "excluded" else DaemonState.FAILED
        if error.code == "excluded" and self._rdzv is not None:
            self._rdzv.excluded.setdefault(self.config.node_id, error.reason)
            self._write_cluster_state(self._rdzv)
        log.error("%s", error.reason)
        self._set_state(state, error.reason)
        return 1

    async def _run_multi(self, rdzv: Rendezvous) -> int:
        """Rounds until the job succeeds or fails, this node is excluded or the store is lost."""
        if self._rdzv_error is not None:
            return self._left(self._rdzv_error)
        stop, lost = self._stop_requested, rdzv.lost
        while True:
            if stop.is_set():
                return self._stopped()
            self._set_state(DaemonState.RENDEZVOUS, "joining the next round")
            try:
                first = await self._first(rdzv.next_round(), stop.wait(), lost.wait())
                if stop.is_set():
                    return self._stopped()
                if lost.is_set():
                    raise RendezvousError(rdzv.lost_reason, "store_lost")
                rnd: Round = first.result()
                if rnd.group_rank == 0:  # node rank 0 hosts this attempt's workers' store
                    host, port = await self._stores.fresh()
                    await rdzv.publish_master(rnd, host, port)
                else:
                    host, port = await rdzv.master(rnd)
            except RendezvousError as error:
                return self._left(error)
            ended = rdzv.watch(rnd.number)
            self.status.restart_count = rnd.restarts
            self._write_cluster_state(rdzv)
            self.events.emit(
                "round_closed", round=rnd.number, members=rnd.node_ids, group_rank=rnd.group_rank
            )
            log.info(
                "round %d: node rank %d of %d (%s)",
                rnd.number,
                rnd.group_rank,
                len(rnd.members),
                ", ".join(rnd.node_ids),
            )
            group = await self._start_attempt(rnd.placement(host, port), rnd.number)
            self._set_state(DaemonState.RUNNING)
            try:
                request = await self._attempt(rdzv, rnd, group, ended)
            except RendezvousError as error:
                if self._group is not None:
                    await self._stop_group(self._group)
                return self._left(error)
            if request is None:
                return self._stopped()
            if request.action != "restart":
                await rdzv.leave(rnd)  # then the store's host may leave: that is no loss
            if request.action == "restart":
                self._set_state(DaemonState.RESTARTING, request.reason)
                continue
            if request.action == "succeed":
                self._set_state(DaemonState.SUCCEEDED, request.reason)
                return 0
            self._set_state(DaemonState.FAILED, request.reason)
            if self.status.last_failure is not None:
                self._print_summary(self.status.last_failure, group)
            else:
                log.error("the job failed: %s", request.reason)
            return 1

    async def _attempt(
        self,
        rdzv: Rendezvous,
        rnd: Round,
        group: WorkerGroup,
        ended: asyncio.Future[ClusterRequest],
    ) -> ClusterRequest | None:
        """Run one round's attempt to its end: the request in force (None: stopped by a signal).
        The workers are stopped when it returns."""
        stop, lost = self._stop_requested, rdzv.lost
        first = await self._first(group.wait(), ended, stop.wait(), lost.wait())
        if stop.is_set():
            await self._stop_group(group)
            with contextlib.suppress(RendezvousError, TimeoutError):
                reason = f"node {self.config.node_id} was stopped by a signal"
                await asyncio.wait_for(
                    rdzv.request(rnd.number, self._cluster_request("restart", reason, False)), 2
                )
            return None
        if lost.is_set() or (first is ended and ended.exception() is not None):
            log.error("%s: stopping the workers", rdzv.lost_reason or "store lost")
            await self._stop_group(group)
            raise RendezvousError(rdzv.lost_reason or "store lost", "store_lost")
        if first is ended:
            request = ended.result()
            log.warning("round %d ended by %s: %s", rnd.number, request.by, request.reason)
            self.events.emit("cluster_request", round=rnd.number, **request.__dict__)
            await self._stop_group(group)
            return request
        outcome: Failure | None = first.result()
        health = self.health
        assert health is not None
        health.detach()
        if self.config.ft.calc_timeouts:
            health.learn(by="ftd (calc_timeouts)")
        if outcome is None:
            await self._stop_group(group)
            await rdzv.succeeded(rnd)
            # torchrun's exit barrier: a failure elsewhere still restarts this node's ranks.
            log.info("round %d: every local rank exited 0; waiting for the other nodes", rnd.number)
            await self._first(ended, stop.wait(), lost.wait())
            if not ended.done():
                return None if stop.is_set() else await self._attempt_lost(rdzv)
            if ended.exception() is not None:
                return await self._attempt_lost(rdzv)
            return ended.result()
        self.status.last_failure = outcome
        self.events.emit("attempt_failed", attempt=rnd.number, failure=outcome.to_dict())
        workload = health.workload_request
        if workload is not None and workload.action is WorkloadAction.EXCLUDE_THIS_NODE:
            await self._stop_group(group)
            reason = f"node {self.config.node_id} excluded: {workload.reason()}"
            await rdzv.exclude(self.config.node_id, reason)
            return await rdzv.request(rnd.number, self._cluster_request("restart", reason, False))
        used = await rdzv.restarts_used()
        decision = after_attempt(
            outcome, used, self.config.max_restarts, workload.reason() if workload else None
        )
        if decision.action is Action.RESTART and self.config.restart_policy == "min-healthy":
            healthy = await rdzv.unhealthy(rnd)
            if healthy >= self.config.nnodes_min:
                await self._stop_group(group)
                self._set_state(
                    DaemonState.RESTARTING,
                    f"{outcome.reason}; {healthy} healthy nodes left (min-healthy): "
                    "waiting for the cluster",
                )
                await self._first(ended, stop.wait(), lost.wait())
                if not ended.done():
                    return None if stop.is_set() else await self._attempt_lost(rdzv)
                if ended.exception() is not None:
                    return await self._attempt_lost(rdzv)
                return ended.result()
        action = "restart" if decision.action is Action.RESTART else "fail"
        request = await rdzv.request(
            rnd.number, self._cluster_request(action, decision.reason, outcome.counted)
        )
        await self._stop_group(group)
        return request

    async def _attempt_lost(self, rdzv: Rendezvous) -> ClusterRequest:
        raise RendezvousError(rdzv.lost_reason or "store lost", "store_lost")

    def _stopped(self) -> int:
        sig = self._stop_signal or signal.SIGTERM
        self._set_state(DaemonState.STOPPED, f"received {sig.name}")
        return 128 + int(sig)

    async def _rendezvous(self) -> Placement:
        host, port = await self._stores.fresh()
        nproc = self.config.nproc_per_node
        return Placement(
            group_rank=0,
            group_world_size=1,
            base_global_rank=0,
            world_size=nproc,
            master_addr=host,
            master_port=port,
        )

    async def _start_attempt(self, placement: Placement, restart_count: int) -> WorkerGroup:
        self.status.attempt = restart_count
        health = self.health
        assert health is not None
        envs = worker_envs(
            self.config,
            placement,
            restart_count,
            str(self.run_dir),
            self.daemon_id,
            socket_path=str(health.server.path),
            attempt_log_dir=str(self.run_dir / f"attempt_{restart_count}"),
        )
        inprocess = self._inprocess_store()
        if inprocess is not None:
            prefix = prefix_for(self.config.run_id, restart_count)
            for env in envs.values():
                env.update(rank_env(inprocess, prefix))
        self._arm_simulated_fault(envs, restart_count)
        self.status.ranks = [
            RankStatus(local_rank=lr, global_rank=placement.base_global_rank + lr) for lr in envs
        ]
        spec = LaunchSpec(
            name=self.config.role,
            cmd=self._cmd,
            envs=envs,
            log_dir=self.log_dir,
            redirects=self.config.redirects,
            tee=self.config.tee,
            local_ranks_filter=self.config.local_ranks_filter,
            log_line_prefixes=_log_line_prefixes(self.config.role, placement, len(envs)),
        )
        guard = self._guard
        assert guard is not None
        health.server.pause()  # the ranks' first messages wait until their pids are attached
        try:
            group = await WorkerGroup.start(
                self._spawner,
                spec,
                {status.local_rank: status for status in self.status.ranks},
                on_register=guard.register,
                on_unregister=guard.unregister,
                daemon_id=self.daemon_id,
            )
            self._group = group
            health.attach(group, self.status.ranks)
        finally:
            health.server.resume()
        group.exit_listeners.append(
            lambda rank: self.events.emit("rank_exited", attempt=restart_count, **rank.to_dict())
        )
        if inprocess is not None:
            rounds = InprocessRounds(
                group=group,
                store_addr=inprocess,
                prefix=prefix,
                world_size=placement.world_size,
                local_slots={s.local_rank: s.global_rank for s in self.status.ranks},
                leader=placement.group_rank == 0,
                first_round_store=(placement.master_addr, placement.master_port),
                fresh_round_store=self._stores.fresh,
                respawn=self.config.inprocess_respawn,
                respawn_budget=self._respawn_budget,
                events=self.events,
                node_id=self.config.node_id,
                on_respawned=self._on_respawned,
            )
            await rounds.start()
            self._rounds = rounds
        self.events.emit(
            "attempt_started",
            attempt=restart_count,
            pids=group.pids,
            master_port=placement.master_port,
        )
        log.info(
            "attempt %d: started local ranks %s (logs in %s)",
            restart_count,
            group.pids,
            group.attempt_log_dir,
        )
        return group

    def _arm_simulated_fault(self, envs: dict[int, dict[str, str]], attempt: int) -> None:
        """`--ft-param-simulated_fault`: one rank of the first attempt carries the fault out."""
        spec = self.config.ft.simulated_fault
        if spec is None or attempt != 0:
            return
        kind, target, low_s, high_s = parse_simulated_fault(spec)
        by_global = {int(env["RANK"]): local for local, env in envs.items()}
        world = int(envs[0]["WORLD_SIZE"])
        chooser = random.Random()
        global_rank = target if target is not None else chooser.randrange(world)
        if global_rank not in by_global:
            return  # the target rank lives on another node
        delay_s = round(chooser.uniform(low_s, high_s), 3)
        envs[by_global[global_rank]]["FTD_SIMULATED_FAULT"] = f"{kind}:{delay_s}"
        self.events.emit("fault_armed", kind=kind, global_rank=global_rank, delay_s=delay_s)
        log.warning("simulated %s fault armed on rank %d in %.3fs", kind, global_rank, delay_s)

    # -- in-process restart (ftd/inprocess.py runs the rounds) --------------------------------

    def _inprocess_store(self) -> tuple[str, int] | None:
        """Where the ranks' in-process rounds meet: the daemons' store (None: process mode)."""
        if self.config.restart_mode != "inprocess":
            return None
        if self._rdzv is not None:
            return self._rdzv.endpoint
        assert self._coordination is not None
        return self._store_host, int(self._coordination.port)

    async def _respawn_budget(self, failure: Failure) -> bool:
        """Whether a failed rank may be respawned: a restart counted against --max-restarts."""
        if self._rdzv is not None:
            return await self._rdzv.count_restart() <= self.config.max_restarts
        if self._restarts_used >= self.config.max_restarts:
            return False
        self._restarts_used += 1
        self.status.restart_count = self._restarts_used
        self._write_status()
        return True

    def _on_respawned(self, local_rank: int, old_pid: int | None) -> None:
        status = next(s for s in self.status.ranks if s.local_rank == local_rank)
        if self.health is not None:
            self.health.respawned(status, old_pid)
        self._write_status()

    async def _stop_group(self, group: WorkerGroup) -> None:
        rounds, self._rounds = self._rounds, None
        if rounds is not None:
            await rounds.close()
        if group is self._group:
            self._group = None
        sig = signal.Signals[self.config.termination_signal]
        await group.stop(sig, self.config.shutdown_timeout_s, force=self._force)
        self.events.emit("workers_stopped", attempt=self.status.attempt)
        self._write_status()

    def _print_summary(self, root: Failure, group: WorkerGroup) -> None:
        others = [s for s in self.status.ranks if s.state is RankState.FAILED]
        summary = failure_summary(
            " ".join(self._cmd[-1 - len(self.config.script_args) :][:1]),
            root,
            others,
            group.error_files,
        )
        log.error("restarts exhausted, the job failed:\n%s", summary)
        root_time = time.strftime("%Y-%m-%d_%H:%M:%S", time.localtime(root.timestamp))
        log.debug("first failure at %s", root_time)


def _log_line_prefixes(role: str, placement: Placement, nprocs: int) -> dict[int, str] | None:
    template = os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
    if not template:
        return None
    from string import Template

    return {
        lr: Template(template).safe_substitute(
            role_name=role, rank=placement.base_global_rank + lr, local_rank=lr
        )
        for lr in range(nprocs)
    }


def _thread_stacks() -> str:
    """Every thread's stack, for a log line that says where teardown is stuck."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(
        f"--- {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
        for ident, frame in frames.items()
    )


async def _run_sync(step: Callable[[], object]) -> None:
    """A teardown step that must run on the loop's thread (it unregisters readers)."""
    step()


def _deliver_fault(group: WorkerGroup, local_rank: int, pid: int, signal_number: int) -> None:
    """The rank's ftd_client carries the fault out on this signal; a rank that was replaced
    since the request is left alone."""
    if group.pids.get(local_rank) == pid and group.statuses[local_rank].exit_code is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal_number)
