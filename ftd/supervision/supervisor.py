"""The attempt loop, written once for one node and for many.

    join a round → start the attempt → first outcome (an exit, a hang, a request, a lost node,
    a signal) → policy → the round's one request → stop → back-off if failing fast → next round

What differs between one node and many lives behind the Coordinator (coordination/).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from typing import Any

from ftd_client.protocol import WorkloadAction

from ftd import containment
from ftd.coordination import CoordinationError, Round
from ftd.coordination.base import new_request
from ftd.coordination.records import Member, RequestRecord
from ftd.ranks.gpu_memory import GpuMemory
from ftd.status.board import StatusBoard
from ftd.status.event_kind import EventKind
from ftd.status.model import DaemonState, Failure
from ftd.supervision.attempt import Attempt, AttemptTools, Running
from ftd.supervision.job_culprit import JobCulpritShare
from ftd.supervision.no_progress import ProgressGuard
from ftd.supervision.node_health import NodeHealth
from ftd.supervision.policy import Action, Decision, after_attempt, asks_the_healthy_first
from ftd.supervision.restarts import CrashLoop, RecoveryTimeline
from ftd.supervision.summary import ending_headline, failure_cause, final_cause
from ftd.tasks import Background, first_of, within

log = logging.getLogger("ftd.daemon")

SIGNAL_REQUEST_TIMEOUT_S = 2.0
CRASHES = frozenset({"exit", "signal", "hang", "fatal", "internal", "start"})
"""Failures that count toward the crash loop's back-off (not a request, a lost node)."""


def _request_of(decision: Decision, failure: Failure, me: str) -> RequestRecord:
    """What this node asks of the round after `failure`, as the policy decided."""
    hang = failure.kind == "hang"  # then every node takes part in naming the job's culprit
    if decision.action is Action.RESTART:
        return new_request("restart", decision.reason, me, counted=failure.counted, hang=hang)
    return new_request("fail", decision.reason, me, exit_code=decision.exit_code, hang=hang)


def _meaning(request: RequestRecord) -> tuple[DaemonState, str]:
    """What the round's request means for this node while its ranks are being stopped."""
    state = DaemonState.RESTARTING if request.action == "restart" else DaemonState.STOPPING
    return state, request.reason


class Supervisor:
    """Runs rounds until the job succeeds, fails, or this node leaves it."""

    def __init__(
        self,
        tools: AttemptTools,
        board: StatusBoard,
        background: Background,
        stop: asyncio.Event,
        force: asyncio.Event,
        address: str,
        running: Running,
    ) -> None:
        self.tools = tools
        self.config = tools.config
        self.coordinator = tools.coordinator
        self.board = board
        self.background = background
        self.stop = stop
        self.force = force
        self.address = address
        self.running = running
        self.recovery = RecoveryTimeline(tools, background)
        self.crash_loop = CrashLoop(tools, board, stop)
        self.culprits = JobCulpritShare(tools, background, self.recovery)
        self.no_progress = ProgressGuard(self.config.ft, tools.events)
        self.gpu_memory = GpuMemory(self.config.ft, tools.events)
        self.node_health = NodeHealth(self.config, tools.events, board, self.coordinator)
        """Attempts in a row that did not move the job's checkpoint iteration."""

    @property
    def status(self) -> Any:
        return self.tools.status

    # -- the loop ----------------------------------------------------------------------------

    async def run(self) -> int:
        """Rounds until the job ends for this node; the process exit code."""
        coordinator = self.coordinator
        while True:
            if self.stop.is_set():
                return self._stopped()
            self.board.set_state(DaemonState.RENDEZVOUS, "joining the next round")
            try:
                rnd = await self._join()
            except CoordinationError as error:
                return self.leave(error)
            if rnd is None:
                return self._stopped()
            ended = coordinator.ended(rnd)
            if not await self._ready_to_spawn():  # a signal during the zygote's preload
                ended.cancel()
                return self._stopped()
            try:
                attempt, request, ran_s = await self._attempt(rnd, ended)
            except CoordinationError as error:
                return self.leave(error)
            finally:
                self.running.now_running(None)
                if not ended.done():
                    ended.cancel()
            if request is None:
                return self._stopped()
            self.culprits.round_ended(rnd, request)
            if request.action != "restart":
                await coordinator.leave(rnd)
            if request.action == "restart":
                self.board.set_state(DaemonState.RESTARTING, request.reason)
                await self.gpu_memory.reclaimed(self.stop)
                await self.crash_loop.back_off(rnd.number, ran_s)
                self.recovery.backed_off()
                continue
            if request.action == "succeed":
                self.board.set_state(DaemonState.SUCCEEDED, request.reason)
                return 0
            self.board.set_state(DaemonState.FAILED, request.reason, final_cause(self.status))
            failure = self.status.last_failure
            if failure is not None:
                summary = failure.reason  # if the summary fails, the reason alone
                if attempt is not None:
                    summary = containment.call("summary", attempt.failure_summary, failure) or (
                        failure.reason
                    )
                log.error("%s:\n%s", ending_headline(request.reason), summary)
            else:
                log.error("the job failed: %s", request.reason)
            return request.exit_code

    async def _attempt(
        self, rnd: Round, ended: asyncio.Future[RequestRecord]
    ) -> tuple[Attempt | None, RequestRecord | None, float]:
        """Start the round's ranks and run them to the round's end: the attempt (None when its
        ranks could not be started), the request in force (None: stopped by a signal), and
        the seconds it ran. The workers are stopped when it returns."""
        started = time.monotonic()
        try:
            attempt = await Attempt.start(self.tools, rnd)
        except Exception as error:  # a full disk, no processes left: a failed attempt
            return None, await self._not_started(rnd, error), time.monotonic() - started
        self.running.now_running(attempt)
        self.crash_loop.crashed = False
        self.recovery.started(attempt)
        self.board.set_state(DaemonState.RUNNING)
        started = time.monotonic()
        try:
            request = await self._until_request(rnd, attempt, ended)
        except CoordinationError:
            await self._end(attempt, recovering=False)
            raise
        except Exception as error:  # a bug of ours: this attempt fails, supervision goes on
            reason = containment.record("attempt", error)
            with contextlib.suppress(Exception):
                await self._end(attempt, recovering=False)
            failure = Failure(kind="internal", reason=reason, timestamp=time.time())
            request = await self._failed(rnd, failure)
        return attempt, request, time.monotonic() - started

    async def _join(self) -> Round | None:
        """Join the next round with this node's workers' store ready; None when stopped."""
        config = self.config
        if not await self.node_health.until_healthy(self.stop):
            return None
        if config.master_port:
            port = config.master_port  # a fixed port is bound by node rank 0 once it is known
        else:
            fresh = await self._workers_store()
            if fresh is None:
                return None
            port = fresh
        me = Member(
            node_id=config.node_id,
            addr=self.address,
            nproc=config.nproc_per_node,
            store_port=port,
            order=config.node_rank,
        )
        join = asyncio.ensure_future(self.coordinator.join(me, self.board))
        first = await first_of(join, self.stop.wait(), self.coordinator.lost.wait())
        if first is not join:
            join.cancel()
            with contextlib.suppress(asyncio.CancelledError, CoordinationError):
                await join
            if self.stop.is_set():
                return None
            raise CoordinationError(self.coordinator.lost_reason, "store_lost")
        rnd: Round = join.result()
        if rnd.group_rank == 0 and config.master_port and await self._workers_store() is None:
            return None
        self.running.now_in(rnd)
        self.board.round_joined(rnd.number, rnd.group_rank, rnd.restarts)
        # A node of a large round holds no list (coordination/assignment.py): its count.
        listed = rnd.node_ids or ()
        self.board.write_cluster(rnd.number, listed, dict(self.coordinator.excluded), rnd.size)
        self.tools.events.emit(
            EventKind.ROUND_CLOSED,
            round=rnd.number,
            members=list(listed),  # an event holds JSON's types
            size=rnd.size,
            group_rank=rnd.group_rank,
        )
        if self.config.multi_node:
            ids = ", ".join(listed) if listed else f"node rank 0: {rnd.leader_id}"
            log.info("round %d: node rank %d of %d (%s)", rnd.number, rnd.group_rank, rnd.size, ids)
        self.recovery.round_closed()
        return rnd

    async def _ready_to_spawn(self) -> bool:
        """Wait for the start method to be ready (the zygote's preload), unless stopped first:
        a signal then starts no rank at all."""
        ready = asyncio.ensure_future(asyncio.to_thread(self.tools.spawner.prepare))
        await first_of(ready, self.stop.wait())
        return not self.stop.is_set()

    async def _workers_store(self) -> int | None:
        """A fresh workers' store for the next attempt: its port (None: stopped)."""
        return await self.tools.stores.fresh_port(self.stop, self.config.rdzv_join_timeout_s)

    async def _until_request(
        self, rnd: Round, attempt: Attempt, ended: asyncio.Future[RequestRecord]
    ) -> RequestRecord | None:
        """Run the attempt to the round's end: the request in force (None: stopped by a
        signal). The workers are stopped when it returns."""
        coordinator, health = self.coordinator, self.tools.health
        stop, lost = self.stop, coordinator.lost
        first = await first_of(attempt.group.wait(), ended, stop.wait(), lost.wait())
        containment.inject("attempt")
        if stop.is_set():
            await self._end(attempt, (DaemonState.STOPPING, "received a signal"), recovering=False)
            if self.config.multi_node:
                me = self.config.node_id
                request = new_request("restart", f"node {me} was stopped by a signal", me)
                with contextlib.suppress(CoordinationError, TimeoutError):
                    await within(coordinator.request(rnd, request), SIGNAL_REQUEST_TIMEOUT_S)
            return None
        if lost.is_set() or (first is ended and ended.exception() is not None):
            log.error("%s: stopping the workers", coordinator.lost_reason or "store lost")
            await self._end(attempt, recovering=False)
            raise CoordinationError(coordinator.lost_reason or "store lost", "store_lost")
        if first is ended:
            request = ended.result()
            log.warning("round %d ended by %s: %s", rnd.number, request.by, request.reason)
            self.tools.events.emit(
                EventKind.CLUSTER_REQUEST, round=rnd.number, **request.model_dump()
            )
            self.recovery.begin(request.reason, None)
            if request.action == "restart" and request.counted:  # every node counts it
                self.no_progress.after_failure(rnd.number, None, self.tools.checkpoints)
            await self._end(attempt, _meaning(request))
            return request
        outcome: Failure | None = first.result()
        health.detach(attempt.group)
        if self.config.ft.calc_timeouts:
            # If learning fails, the timeouts in force stay.
            containment.call("learning", health.learn, by="ftd (calc_timeouts)")
        if outcome is None:
            await self._end(attempt, recovering=False)
            await coordinator.succeeded(rnd)
            if self.config.multi_node:
                log.info(
                    "round %d: every local rank exited 0; waiting for the other nodes", rnd.number
                )
            return await self._await_end(ended)
        self._record_failure(rnd, outcome)
        workload = health.workload_request
        me = self.config.node_id
        if (
            workload is not None
            and workload.action is WorkloadAction.EXCLUDE_THIS_NODE
            and self.config.multi_node
        ):
            await self._end(attempt)
            reason = f"node {me} excluded: {workload.reason()}"
            await coordinator.exclude(me, reason)
            return await coordinator.request(rnd, new_request("restart", reason, me))
        used = await coordinator.restarts_used(rnd)
        decision = after_attempt(
            outcome,
            used,
            self.config.max_restarts,
            workload.reason() if workload else None,
            self.no_progress.after_failure(rnd.number, outcome, self.tools.checkpoints),
        )
        if asks_the_healthy_first(decision, self.config.restart_policy):
            healthy = await coordinator.unhealthy(rnd, me)
            if healthy >= self.config.nnodes_min:
                why = f"{healthy} healthy nodes left (min-healthy): waiting for the cluster"
                await self._end(attempt, (DaemonState.RESTARTING, f"{outcome.reason}; {why}"))
                return await self._await_end(ended)
        request = await coordinator.request(rnd, _request_of(decision, outcome, me))
        await self._end(attempt, _meaning(request))
        return request

    async def _end(
        self,
        attempt: Attempt | None,
        state: tuple[DaemonState, str] | None = None,
        recovering: bool = True,
    ) -> None:
        """The one way an attempt ends: what it means said first (the node's `state`), then
        its ranks stopped and unwatched (Attempt.stop; None: none were started), then, with
        `recovering`, the current recovery's stop marked."""
        if state is not None:
            self.board.set_state(*state)
        if attempt is not None:
            await attempt.stop(self.force)
        if recovering:
            self.recovery.stopped()

    async def close(self) -> None:
        """The daemon's exit: an attempt still running ends as every other does."""
        if self.running.attempt is not None:
            await self._end(self.running.attempt, recovering=False)

    def _record_failure(self, rnd: Round, failure: Failure) -> None:
        """What every failed attempt records, once: the board, the crash loop's count, the
        event, the recovery's beginning."""
        self.board.attempt_failed(failure, failure_cause(failure))
        self.crash_loop.crashed = failure.kind in CRASHES
        self.tools.events.emit(
            EventKind.ATTEMPT_FAILED, attempt=rnd.number, failure=failure.to_dict()
        )
        self.recovery.begin(failure.reason, failure)

    async def _not_started(self, rnd: Round, error: Exception) -> RequestRecord:
        """The ranks could not be started (their log directory on a full disk, fork failing):
        the attempt failed for that reason, and the policy decides as after any failure (a
        restart, counted and backed off, or the job's end)."""
        why = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
        reason = f"the ranks of attempt {rnd.number} could not be started: {why}"
        if isinstance(error, OSError | TimeoutError):
            log.error("%s", reason)
        else:  # not the machine's doing: a bug of ours, said once with its origin
            containment.record("attempt", error)
        return await self._failed(rnd, Failure(kind="start", reason=reason, timestamp=time.time()))

    async def _failed(self, rnd: Round, failure: Failure) -> RequestRecord:
        """The attempt failed outside its ranks (they could not start; a part of the daemon
        failed): the policy decides as after any failure."""
        self._record_failure(rnd, failure)
        me = self.config.node_id
        used = await self.coordinator.restarts_used(rnd)
        stuck = self.no_progress.after_failure(rnd.number, failure, self.tools.checkpoints)
        decision = after_attempt(failure, used, self.config.max_restarts, stuck=stuck)
        request = await self.coordinator.request(rnd, _request_of(decision, failure, me))
        await self._end(None, _meaning(request))
        return request

    async def _await_end(self, ended: asyncio.Future[RequestRecord]) -> RequestRecord | None:
        """This node is done with the round; the others decide how it ends."""
        await first_of(ended, self.stop.wait(), self.coordinator.lost.wait())
        if not ended.done():
            if self.stop.is_set():
                return None
            raise CoordinationError(self.coordinator.lost_reason or "store lost", "store_lost")
        if ended.exception() is not None:
            raise CoordinationError(self.coordinator.lost_reason or "store lost", "store_lost")
        return ended.result()

    # -- endings -----------------------------------------------------------------------------

    def _stopped(self) -> int:
        sig = self.running.stop_signal or signal.SIGTERM
        self.board.set_state(DaemonState.STOPPED, f"received {sig.name}")
        return 128 + int(sig)

    def leave(self, error: CoordinationError) -> int:
        """This node leaves the job for `error.reason`: the process exit code."""
        if error.code == "stopped":
            return self._stopped()
        if error.code == "succeed":
            self.board.set_state(DaemonState.SUCCEEDED, error.reason)
            return 0
        state = DaemonState.STOPPED if error.code == "excluded" else DaemonState.FAILED
        if error.code == "excluded":
            excluded = {**self.coordinator.excluded, self.config.node_id: error.reason}
            rnd = self.running.round
            listed, size = ((rnd.node_ids or ()), rnd.size) if rnd else ((), 0)
            self.board.write_cluster(rnd.number if rnd else None, listed, excluded, size)
        log.error("%s", error.reason)
        self.board.set_state(state, error.reason)
        return 1
