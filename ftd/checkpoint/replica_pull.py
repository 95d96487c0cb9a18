"""A replacement node's pull of a rank's snapshots from the peers' replicas (docs/checkpoint.md),
asked for by a rank's restore (`ckr`), which the rank sends with a world size of its choosing.

Budgets, since every `ckr` could start one: one pull per (rank, world), never a second while
the first is in flight or after it ended in this round; the world must be the current round's
when there is one, and at most MAX_WORLDS of them per rank in a round (`other_world`,
`too_many_worlds`, `bad_world` for a rank outside it: refused, counted, said once per cause).
Toward one peer at most PER_PEER connections at a time, below its server's cap of 8 so that
pushes still get in; a peer that refused or failed is tried again after a back-off, ATTEMPTS
times within PULL_TIMEOUT_S, and a pull that still fails is said in the log, counted
(`pull_failed`) and a `replica_pulled` event with the error: never dropped silently. The bytes
being received count against --checkpoint-memory (ReplicaStore.incoming).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from ftd.checkpoint.replica_client import fetch
from ftd.checkpoint.replica_frame import FrameError
from ftd.checkpoint.replica_ring import Ring
from ftd.checkpoint.replica_store import Incoming, ReplicaStore
from ftd.refusals import Refusals
from ftd.status.event_kind import EventKind
from ftd.status.events import EventLog

if TYPE_CHECKING:
    from ftd.checkpoint.holder import CheckpointHolder

log = logging.getLogger("ftd.checkpoint")

RETRY_S = 0.5
PULL_TIMEOUT_S = 30.0
"""The longest one peer's answers to a pull may take, its tries together (a rank waits)."""
PEERS_WAIT_S = 5.0
"""The longest a pull waits for the round's members to have published their replica servers."""
PER_PEER = 4
"""Pulls in flight toward one peer (its server takes 8 connections)."""
ATTEMPTS = 4
BACKOFF_S = 0.25
"""The first pause before a peer is asked again; doubled each time."""
MAX_WORLDS = 2


def pauses() -> list[float]:
    """The pause before each try of one peer: none, then doubling from BACKOFF_S."""
    return [0.0] + [BACKOFF_S * 2**n for n in range(ATTEMPTS - 1)]


class Pulls:
    def __init__(
        self,
        key: bytes,
        node_id: str,
        events: EventLog,
        ring: Ring,
        refresh: Callable[[], Awaitable[None]],
        refused: Refusals,
    ) -> None:
        """`refresh`: reads the round and the peers' summaries into `ring`."""
        self.key = key
        self.node_id = node_id
        self.events = events
        self.ring = ring
        self._refresh = refresh
        self.refused = refused
        self._tasks: dict[tuple[int, int], asyncio.Task[None]] = {}
        self._worlds: dict[int, set[int]] = {}
        self._round: int | None = None
        self._peers: dict[str, asyncio.Semaphore] = {}
        self._said: set[str] = set()
        self.pulled = 0

    def restoring(
        self,
        rank: int,
        world: int,
        current: tuple[int, int] | None,
        store: ReplicaStore,
        holder: CheckpointHolder,
    ) -> bool:
        """True while the pull of (rank, world) runs; starts it (within the budgets) if new.
        `current`: the round's number and world size, when there is a round."""
        if current is not None and current[0] != self._round:  # a new round: ended pulls
            self._round = current[0]  # are forgotten (another node may have been lost)
            self._tasks = {k: task for k, task in self._tasks.items() if not task.done()}
            self._worlds = {}
            for running_rank, running_world in self._tasks:
                self._worlds.setdefault(running_rank, set()).add(running_world)
        task = self._tasks.get((rank, world))
        if task is None:
            worlds = self._worlds.setdefault(rank, set())
            if current is not None and world != current[1]:
                return self._refuse("other_world", f"rank {rank} asked in a world of {world}")
            if rank >= world:
                return self._refuse("bad_world", f"rank {rank} asked in a world of {world}")
            if len(worlds) >= MAX_WORLDS:
                return self._refuse("too_many_worlds", f"rank {rank} asked in a world of {world}")
            worlds.add(world)
            task = asyncio.ensure_future(self._pull(rank, world, store, holder))
            self._tasks[(rank, world)] = task
        return not task.done()

    def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()

    def _refuse(self, cause: str, detail: str) -> bool:
        self.refused[cause] += 1
        if cause not in self._said:
            self._said.add(cause)
            log.warning("no pull of a rank's replicas (%s): %s", cause, detail)
        return False

    async def _pull(
        self, rank: int, world: int, store: ReplicaStore, holder: CheckpointHolder
    ) -> None:
        """Every peer's replicas of `rank`, into this node's slots (contained: a failure means
        the rank has nothing, and the ranks' agreement says so)."""
        try:
            await self._pull_all(rank, world, store, holder)
        except Exception as error:
            log.exception("pulling rank %d's snapshots from the peers failed", rank)
            self.events.emit(
                EventKind.REPLICA_PULLED, global_rank=rank, steps=[], error=str(error)[:400]
            )

    async def _fetch(
        self, node: str, rank: int, world: int, store: ReplicaStore
    ) -> list[tuple[int, Incoming]]:
        """`node`'s replicas of `rank`, checked whole, tried again after a back-off; none (said,
        counted) when it cannot answer."""
        address = self.ring.addresses.get(node)
        if address is None:
            log.warning("rank %d: node %s published no replica server", rank, node)
            return []
        peer = self._peers.setdefault(node, asyncio.Semaphore(PER_PEER))
        error: BaseException | None = None
        try:
            async with asyncio.timeout(PULL_TIMEOUT_S):
                for pause in pauses():
                    await asyncio.sleep(pause)
                    async with peer:
                        try:
                            return await fetch(
                                self.key, self.node_id, node, address, rank, world, store
                            )
                        except (OSError, FrameError, EOFError) as failed:
                            error = failed
        except TimeoutError as late:
            error = late
        self.refused["pull_failed"] += 1
        said = str(error)[:400] or type(error).__name__
        log.warning("could not pull rank %d's snapshots from %s: %s", rank, node, said)
        self.events.emit(
            EventKind.REPLICA_PULLED, global_rank=rank, source=[node], steps=[], error=said
        )
        return []

    async def _pull_all(
        self, rank: int, world: int, store: ReplicaStore, holder: CheckpointHolder
    ) -> None:
        deadline = asyncio.get_running_loop().time() + PEERS_WAIT_S
        while True:  # this round's members, and their replica servers (published at start)
            with contextlib.suppress(Exception):
                await self._refresh()
            peers = [n for n in self.ring.members if n != self.node_id]
            waiting = [n for n in peers if n not in self.ring.addresses]
            if not waiting or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(RETRY_S)
        got: dict[int, tuple[str, Incoming]] = {}
        fetches = (self._fetch(n, rank, world, store) for n in peers)
        answers = await asyncio.gather(*fetches, return_exceptions=True)
        try:
            for node, answer in zip(peers, answers, strict=True):
                if isinstance(answer, BaseException):
                    log.error("pulling rank %d from %s failed: %r", rank, node, answer)
                    self.refused["pull_failed"] += 1
                    continue
                for step, incoming in answer:
                    if step in got:
                        _drop(store, incoming)
                    else:
                        got[step] = (node, incoming)
            for step in sorted(got):  # oldest first: the ledger takes a newer step for the rank's
                if not holder.adopt(rank, world, step, got[step][1].path):  # history, an older
                    _drop(store, got.pop(step)[1])  # one for its history going back
        finally:
            for _, incoming in got.values():
                _drop(store, incoming)
        if got:  # a fresh job's ranks hold nothing anywhere: nothing to say then
            self.pulled += len(got)
            log.info("rank %d's snapshots from the peers' replicas: steps %s", rank, sorted(got))
            self.events.emit(
                EventKind.REPLICA_PULLED,
                global_rank=rank,
                steps=sorted(got),
                source=sorted({node for node, _ in got.values()}),
            )


def _drop(store: ReplicaStore, incoming: Incoming) -> None:
    incoming.discard()
    store.release(incoming)
