"""In-process restart, the daemon's side (`ftd serve --restart-mode inprocess`).

The ranks run their training function under `ftd_client.inprocess.Wrapper`; each call of it is
a *round*. The protocol (keys and records) is ftd_client/inprocess/keys.py, shared with the
ranks. One `InprocessRounds` per attempt and node; every node's daemon:

- on a local rank's failed exit after the rounds ended well, fails the attempt (a process
  restart follows, as under torchrun); before that, writes it out of the rounds it could be
  waited for in, announces a `rank_exit` fault to every rank of the job when it was a member
  of a running round (the round's fault key, then every rank's wake key: the store reaches
  every node), and starts a new process in its place (`--inprocess-respawn`, counted against
  --max-restarts), which joins the open round; or, without respawn, writes the slot off for
  good so later rounds go on without it.

The leader (node rank 0; the only daemon on a single node) also runs the rounds:

- once every slot arrived at round k's barrier (or was written off), it decides the members and
  gives them a fresh process-group store (MASTER_ADDR:MASTER_PORT), hosted here;
- it waits for round k's fault (its own wake key) and opens round k+1, or stops once every
  member's function returned (the round's `completed` record);
- the members of round k then have the longest hard timeout they announced to arrive at round
  k+1. A straggler (hung in C code, out of reach of its Wrapper) fails the attempt, naming it,
  and the usual process restart follows: every rank is stopped and started again.

Every store call blocks (ftd/ranks/inprocess_store.py: the calls, and how races between a death and
a decision are closed), so each runs in a thread: short operations on one connection and one
thread with a timeout; the leader's two long waits (a barrier, a round's fault) each on a
connection and thread of their own, in chunks so that closing is noticed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ftd_client.inprocess.keys import (
    ENV_PREFIX,
    ENV_RESTART_MODE,
    ENV_STORE_ADDR,
    INPROCESS,
    Fault,
    Keys,
    Members,
    Seal,
)

from ftd.ranks.inprocess_store import Arrivals, InprocessStore, connect
from ftd.ranks.workers import WorkerGroup
from ftd.ranks.workers_store import STORE_OP_TIMEOUT_S
from ftd.status.event_kind import EventKind
from ftd.status.events import EventLog
from ftd.status.model import Failure
from ftd.tasks import Background, within

log = logging.getLogger("ftd.inprocess")

EXPLAIN_TIMEOUT_S = 15.0
"""Bounds the stragglers' stack dumps (faulthandler's, then py-spy's) before the fallback."""
ExplainRanks = Callable[[list[int]], Awaitable[list[str]]]
"""(local ranks) -> notes on the stacks written for them."""
ENV_RESPAWN = "FTD_INPROCESS_RESPAWN"
"""Set in a respawned rank's environment: how many times its local rank was respawned."""

StoreFactory = Callable[[], Awaitable[tuple[str, int]]]
RespawnBudget = Callable[[Failure], Awaitable[bool]]


def rank_env(store_addr: tuple[str, int], prefix: str) -> dict[str, str]:
    """What a rank needs to find this attempt's rounds (docs/environment.md)."""
    host, port = store_addr
    return {
        ENV_RESTART_MODE: INPROCESS,
        ENV_STORE_ADDR: f"{host}:{port}",
        ENV_PREFIX: prefix,
    }


class InprocessRounds:
    """One attempt's in-process rounds on one node; the daemon closes it with the attempt."""

    def __init__(
        self,
        *,
        store_addr: tuple[str, int],
        prefix: str,
        world_size: int,
        local_slots: dict[int, int],
        leader: bool,
        first_round_store: tuple[str, int],
        fresh_round_store: StoreFactory,
        respawn: bool,
        respawn_budget: RespawnBudget,
        events: EventLog,
        node_id: str,
        on_respawned: Callable[[int, int | None], None] | None = None,
        explain_stragglers: ExplainRanks | None = None,
        seal: Seal | None = None,
    ) -> None:
        self._group: WorkerGroup | None = None
        self.explain_stragglers = explain_stragglers
        """Writes the stacks of local ranks (HangHandler.explain_ranks), for the stragglers
        of a round before the attempt fails; notes on what was written."""
        self.store_addr = store_addr
        self.local_slots = local_slots
        """local rank -> slot (its global rank in the attempt)."""
        self.leader = leader
        self.first_round_store = first_round_store
        self.fresh_round_store = fresh_round_store
        self.respawn = respawn
        self.respawn_budget = respawn_budget
        self.events = events
        self.on_respawned = on_respawned
        """Called once a rank's new process runs, with its local rank and the old pid."""
        self.by = f"daemon {node_id}"
        self._closing = threading.Event()
        self._store = InprocessStore(
            store_addr, Keys(prefix), world_size, self.by, self._closing, seal
        )
        self._ops = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ftd-inproc")
        self._waits = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="ftd-inproc-wait")
        self._background = Background()

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def group(self) -> WorkerGroup:
        assert self._group is not None, "attach() comes first"
        return self._group

    async def connect(self) -> None:
        """Connect to the rounds' store: before the ranks start, so that no rank can fail
        before its failure would reach the rounds."""
        await self._op(self._store.connect)

    def lead(self, group: WorkerGroup) -> None:
        """Take the attempt's ranks (started with `rank_failed` as their failure handler), at
        once after they started: no await between, and their exits are callbacks of the loop,
        so no failure reaches `rank_failed` before this."""
        self._group = group
        if self.leader:
            self._background.spawn(self._lead(), "ftd-inprocess-rounds")

    async def close(self) -> None:
        """Stop the rounds (the workers are stopped by the daemon); bounded."""
        self._closing.set()
        if self._store.connected and self.leader:
            try:  # wakes the leader's waits
                await self._op(self._store.stop_waits, self._store.round)
            except Exception as error:
                log.debug("could not stop the fault watch: %s", error)
        await self._background.close()
        self._ops.shutdown(wait=False, cancel_futures=True)
        self._waits.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self._store.disconnect)

    async def _op(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A short blocking store operation, bounded."""
        loop = asyncio.get_running_loop()
        return await within(loop.run_in_executor(self._ops, fn, *args), STORE_OP_TIMEOUT_S * 2)

    # -- every node: a local rank failed -----------------------------------------------------

    def rank_failed(self, failure: Failure) -> None:
        """A local rank failed: its round decides (the group's failure handler)."""
        if self._closing.is_set():  # the rounds are over: the failure ends the attempt
            self.group.fail(failure)
            return
        self._background.spawn(self._rank_failed(failure), f"rank-failed-{failure.local_rank}")

    async def _rank_failed(self, failure: Failure) -> None:
        assert failure.local_rank is not None
        local_rank = failure.local_rank
        slot = self.local_slots[local_rank]
        if await self._op(self._store.rounds_completed):  # nothing left to rejoin
            log.error("%s after the in-process rounds ended well", failure.reason)
            self.group.fail(failure)
            return
        respawn = self.respawn and await self.respawn_budget(failure)
        if self.respawn and not respawn:
            log.error("%s: no restarts left for a respawn", failure.reason)
            self.group.fail(failure)
            return
        try:
            rnd, announced = await self._op(self._store.write_off, slot, respawn, failure.reason)
        except Exception as error:
            self.group.fail(failure)
            log.error("in-process: could not announce %s (%s)", failure.reason, error)
            return
        self.events.emit(
            EventKind.INPROCESS_RANK_FAILED,
            round=rnd,
            global_rank=slot,
            local_rank=local_rank,
            reason=failure.reason,
            respawn=respawn,
            announced=announced,
        )
        if not respawn:
            log.warning("%s: the job goes on without it (--no-inprocess-respawn)", failure.reason)
            self.group.drop(local_rank)
            return
        old_pid = failure.pid
        number = self.group.respawns.get(local_rank, 0) + 1
        pid = await self.group.respawn(local_rank, {ENV_RESPAWN: str(number)})
        log.warning(
            "%s: respawned as pid %d, joining the open in-process round", failure.reason, pid
        )
        self.events.emit(
            EventKind.RANK_RESPAWNED,
            global_rank=slot,
            local_rank=local_rank,
            pid=pid,
            old_pid=old_pid,
        )
        if self.on_respawned is not None:
            self.on_respawned(local_rank, old_pid)

    # -- the leader: the rounds --------------------------------------------------------------

    async def _lead(self) -> None:
        loop = asyncio.get_running_loop()
        host, port = self.store_addr
        barrier, watch = await asyncio.gather(
            loop.run_in_executor(self._waits, connect, host, port),
            loop.run_in_executor(self._waits, connect, host, port),
        )
        try:
            await self._op(self._store.open_first)
            rnd, deadline, hard_timeout_s = 0, None, 0.0
            while not self._closing.is_set():
                arrivals = await loop.run_in_executor(
                    self._waits, self._store.gather, barrier, rnd, deadline
                )
                if self._closing.is_set():
                    return
                if isinstance(arrivals, list):
                    await self._give_up(rnd, arrivals, hard_timeout_s)
                    return
                if not arrivals.live:
                    log.warning("in-process round %d: every rank was written off", rnd)
                    return
                members = await self._decide(rnd, arrivals)
                fault: Fault | None = await loop.run_in_executor(
                    self._waits, self._store.await_fault, watch, rnd
                )
                if fault is None:
                    return
                seen = time.monotonic()
                log.warning(
                    "in-process round %d ended (%s on rank %d: %s; by %s): opening round %d",
                    rnd,
                    fault.kind,
                    fault.rank,
                    fault.reason,
                    fault.by,
                    rnd + 1,
                )
                self.events.emit(
                    EventKind.INPROCESS_FAULT,
                    round=rnd,
                    kind=fault.kind,
                    global_rank=fault.rank,
                    reason=fault.reason,
                    by=fault.by,
                    fault_time=fault.time,
                    members=list(members.slots),
                )
                rnd += 1
                await self._op(self._store.open, rnd)
                hard_timeout_s = arrivals.hard_timeout_s
                deadline = seen + hard_timeout_s
        except (asyncio.CancelledError, concurrent.futures.CancelledError):
            raise
        except Exception as error:
            if not self._closing.is_set():
                log.exception("in-process rounds failed")
                self.group.fail(
                    Failure(kind="inprocess", reason=f"in-process rounds failed: {error}")
                )
        finally:
            barrier.close()
            watch.close()

    async def _decide(self, rnd: int, arrivals: Arrivals) -> Members:
        host, port = self.first_round_store if rnd == 0 else await self.fresh_round_store()
        members = Members(tuple(sorted(arrivals.live)), host, port, self.by)
        changed = await self._op(self._store.publish, rnd, members, arrivals)
        log.info(
            "in-process round %d: ranks %s (process-group store %s:%d)",
            rnd,
            list(members.slots),
            host,
            port,
        )
        self.events.emit(
            EventKind.INPROCESS_ROUND,
            round=rnd,
            members=list(members.slots),
            master_addr=host,
            master_port=port,
            left=changed,
        )
        return members

    async def _give_up(self, rnd: int, stragglers: list[int], hard_timeout_s: float) -> None:
        reason = (
            f"ranks {stragglers} did not reach in-process round {rnd}'s barrier within the "
            f"hard timeout ({hard_timeout_s:g}s): restarting the processes"
        )
        log.error("%s", reason)
        self.events.emit(
            EventKind.INPROCESS_GAVE_UP, round=rnd, stragglers=stragglers, reason=reason
        )
        by_slot = {slot: lr for lr, slot in self.local_slots.items()}
        local = by_slot.get(stragglers[0]) if stragglers else None
        status = self.group.statuses.get(local) if local is not None else None
        # The stragglers' stacks first (this node's; other nodes' leaders see their own): what
        # held them is gone once their processes are restarted.
        local_stragglers = [by_slot[slot] for slot in stragglers if slot in by_slot]
        if self.explain_stragglers is not None and local_stragglers:
            try:
                notes = await within(self.explain_stragglers(local_stragglers), EXPLAIN_TIMEOUT_S)
            except Exception as error:  # never lose the restart to an explanation
                notes = [f"stacks not collected ({error!r})"]
            reason = "; ".join([reason, *notes])
        self.group.fail(
            Failure(
                kind="hang",
                reason=reason,
                local_rank=local,
                global_rank=stragglers[0] if stragglers else None,
                pid=status.pid if status else None,
                timestamp=time.time(),
            )
        )
