"""A replica of each node's snapshots on the next node of the round, and the lost ranks'
snapshots fetched from it by the node that takes a lost node's place (docs/checkpoint.md).

The ring is the current round's members in node-id order; a node pushes to the one after it.
Once a snapshot of each of the node's ranks is complete at one step, that step is pushed in the
background (one push in flight; the newest complete step next, so a slow peer skips steps and
never queues them), every rank's file read in the replicas' few threads while its slot is marked
`sending` (the ledger does not give it to a newer save meanwhile), opened only if it is a regular
file (a FIFO a rank planted is refused, never waited on). The peer acknowledges each one it kept.
Whatever fails in one push is contained: said once per cause, counted, and the loop goes on.
The pull of a replacement node is replica_pull.py's, the peers' summaries replica_ring.py's.

Survivors of a lost node must still hold a step its replica holds: each node publishes the steps
its successor acknowledged for all its ranks (NodeSummary.replicated_steps) and the address of
its replica server; every node reads the others' and keeps every complete snapshot from the
oldest of their second-newest acknowledged steps on (ledger.keep_from, ledger.py says why).

Replication is on only when the job has a secret: the frames are signed with a key derived from
it (replica_frame.py), and without one anyone who reaches the port could plant a rank's state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ftd.checkpoint.replica_client import push
from ftd.checkpoint.replica_frame import FrameError
from ftd.checkpoint.replica_pull import Pulls
from ftd.checkpoint.replica_ring import Ring, floor_for, floor_record, newest_common
from ftd.checkpoint.replica_server import ReplicaServer
from ftd.checkpoint.replica_store import ReplicaStore
from ftd.config.serve import ServeConfig
from ftd.coordination.base import Coordinator
from ftd.coordination.job_share import JobShare
from ftd.refusals import Refusals
from ftd.status.events import EventLog
from ftd.tasks import Background, within

if TYPE_CHECKING:
    from ftd.checkpoint.holder import CheckpointHolder

log = logging.getLogger("ftd.checkpoint")

READ_S = 2.0
"""How often a node looks at the ring: its successor's replica server until known (and after a
push to it failed), and publishes its own summary if its acknowledged steps changed."""
FLOOR_S = 10.0
"""How often node rank 0 gathers the replica floor from every summary (job_share.py) and the
others read it, and at once in a new round: a late floor only keeps more snapshots, and the
gather reads O(N) bytes (issue 43)."""
RETRY_S = 0.5
PUSH_TIMEOUT_S = 60.0
MAX_ACKED = 16


class Replication:
    def __init__(
        self,
        key: bytes,
        node_id: str,
        events: EventLog,
        round_view: Callable[[], tuple[int, Sequence[str], range, int] | None],
        share: JobShare,
        publish: Callable[[], None],
        holder: CheckpointHolder,
    ) -> None:
        """`round_view`: the current round's number, member ids, this node's global ranks and
        the world size (None before the first round); `share`: the members' summaries and what
        node rank 0 gathers of them (the replica floor);
        `publish`: sends the node's summary (whose parts include `summary`) to the others;
        `holder`: the node's snapshots, whose replicas these are."""
        self.key = key
        self.node_id = node_id
        self.events = events
        self._round_view = round_view
        self._share = share
        self._publish = publish
        self.refused = Refusals("replica")
        """What this node refused of its peers' summaries, its ranks' restores and its slots."""
        self.ring = Ring(self.refused)
        self.holder = holder
        self.store: ReplicaStore | None = None
        self.server: ReplicaServer | None = None
        self.host = ""
        self.acked: list[int] = []
        self._acked_by: tuple[int, str | None] | None = None
        """The round and the successor `acked` is of: a step of another round may be another
        history (the job went back to a restored step), another successor holds nothing."""
        self._unpublished = False
        self._wake = asyncio.Event()
        self._background = Background()
        self.pulls = Pulls(key, node_id, events, self.ring, self._read_everyone, self.refused)
        self._failing: set[str] = set()
        self._floor: int | None = None
        self._floor_of: tuple[int, float] | None = None
        """The round of `_floor` and when (monotonic) it was gathered or read."""

    async def start(self, host: str) -> None:
        """Serve replicas on `host` (this node's own address), start the pusher and the reads of
        the peers' summaries, publish the server's address in the node's summary; nothing when
        the holder has no memory directory."""
        holder = self.holder
        if holder.directory is None:
            return
        holder.ledger.keep_replicated(True)  # until the peers said what they replicated: all
        try:
            self.store = ReplicaStore(holder.directory, holder.ledger)
            server = ReplicaServer(self.key, self.node_id, self.store, self.events)
            await server.start(host)
        except OSError as error:  # the node's own tier goes on without replicas
            log.error("snapshots are not replicated: no replica server on %s: %s", host, error)
            holder.ledger.keep_replicated(False)
            return
        self.server, self.host = server, host
        log.info("snapshots are replicated to the next node; replicas served at %s", self.address)
        self._background.spawn(self._push_loop(), "replica-push")
        self._background.spawn(self._watch_loop(), "replica-watch")
        self._publish()

    async def close(self) -> None:
        await self._background.close()
        self.pulls.close()
        if self.server is not None:
            await self.server.close()
        if self.store is not None:
            await asyncio.to_thread(self.store.close)

    @property
    def address(self) -> str | None:
        return f"{self.host}:{self.server.port}" if self.server is not None else None

    def summary(self) -> dict[str, Any]:
        """This node's part of its published summary (none until its server is up)."""
        if self.server is None:
            return {}
        return {
            "replica_addr": self.address,
            "replicated_steps": tuple(self.acked),
            "replicated_round": self._acked_by[0] if self._acked_by else None,
        }

    # -- the holder's hooks ------------------------------------------------------------------

    def completed(self) -> None:
        """A rank's snapshot is complete: maybe a newer step to push."""
        self._wake.set()

    def restoring(self, rank: int, world: int) -> bool:
        """A rank asks to restore and this node holds nothing of it: fetch it from the peers'
        replicas first. True while that runs (the rank asks again)."""
        if self.server is None or self.store is None:
            return False  # not replicating (no memory directory, no server)
        view = self._round_view()
        current = (view[0], view[3]) if view is not None else None
        return self.pulls.restoring(rank, world, current, self.store, self.holder)

    def view(self) -> dict[str, Any]:
        """The status' `replica_lag_steps` and `replica` (openapi.yaml NodeCheckpoint)."""
        holder = self.holder
        if self.store is None or self.server is None:
            return {"replica_lag_steps": None, "replica": None}
        newest = self._newest_complete()
        acked = self.acked[-1] if self.acked else None
        successor = self.ring.successor(self.node_id)
        lag = None if newest is None or successor is None else newest - (acked or 0)
        return {
            "replica_lag_steps": max(lag, 0) if lag is not None else None,
            "replica": {
                "address": self.address,
                "successor": successor,
                "replicated_step": acked,
                "keep_from": holder.ledger.keep_from,
                "kept_busy": holder.ledger.pinned_busy,
                **self.store.view(),
                "received": self.server.pushes,
                "pulled": self.pulls.pulled,
                "refused": sum(self.server.refused.values()) + sum(self.refused.values()),
            },
        }

    # -- the ring ----------------------------------------------------------------------------

    async def _watch_loop(self) -> None:
        failing = False
        while True:
            try:
                await self._watch()
                failing = False
            except Exception as error:  # the rendezvous is lost or busy: the next look retries
                if not failing:
                    log.warning("could not read the peers' replica servers: %s", error)
                failing = True
            await asyncio.sleep(READ_S)

    async def _watch(self) -> None:
        """A look at the ring: the replica floor, which node rank 0 gathers from every summary
        and the others read (job_share.py), and the successor's replica server."""
        view = self._round_view()
        if view is None:
            return
        self.ring.number, self.ring.members, self.ring.ranks, self.ring.world = view
        successor = self.ring.successor(self.node_id)
        taken = self._floor_of
        if taken is None or taken[0] != self.ring.number or time.monotonic() - taken[1] >= FLOOR_S:
            gathered: dict[str, Any] | None = None
            if self._share.leading():
                self.ring.read(await self._share.every_summary())
                gathered = floor_record(self.ring, time.time())
                await self._share.publish("replica_floor", gathered)
            else:
                gathered = await self._share.read("replica_floor")
            self._floor = floor_for(gathered, self.node_id)
            self._floor_of = (self.ring.number, time.monotonic())
        # Its server's address is read until known, and again after a push failed.
        known = successor in self.ring.addresses and not self._failing
        if successor is not None and not known:
            self.ring.read([s for s in [await self._share.summary_of(successor)] if s])
        floor = self._floor
        now = (self.ring.number, successor)
        if now != self._acked_by:
            self._acked_by, self.acked = now, []
            self._unpublished = True
        if self._unpublished:
            self._unpublished = False
            self._publish()
        # Alone: nobody's replica to wait for.
        self.holder.ledger.keep_replicated(len(self.ring.members) > 1, floor)
        self._wake.set()

    async def _read_everyone(self) -> None:
        """Every member's replica server (a replacement node's pull asks every peer)."""
        view = self._round_view()
        if view is not None:
            self.ring.number, self.ring.members, self.ring.ranks, self.ring.world = view
            nodes = await self._share.every_summary()
            active = tuple(
                n["node_id"]
                for n in nodes
                if n.get("role") == "active" and isinstance(n.get("node_id"), str)
            )
            if len(active) > len(self.ring.members):  # a node that holds no list: the view's
                self.ring.members = active
            self.ring.read(nodes)

    def _newest_complete(self) -> int | None:
        """The newest step complete on every rank of this node in this round."""
        ranks = self.holder.ledger.ranks()
        held = [
            set(ranks[r].complete_steps(self.ring.world)) if r in ranks else set()
            for r in self.ring.ranks
        ]
        return newest_common(held) if held else None

    async def _push_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._push_newest()
            except Exception as error:  # contained: the next completed save or look retries
                self.refused["push_error"] += 1
                self._push_failed("push_error", error)
                await asyncio.sleep(RETRY_S)

    async def _push_newest(self) -> None:
        successor = self.ring.successor(self.node_id)
        step = self._newest_complete()
        address = self.ring.addresses.get(successor) if successor else None
        if step is None or address is None or (self.acked and step <= self.acked[-1]):
            return
        try:
            await within(self._push(successor, address, step), PUSH_TIMEOUT_S)
        except FrameError as error:  # a slot that is no file, a peer that is not the successor
            self.refused[error.cause] += 1
            self._push_failed(error.cause, error)
            await asyncio.sleep(RETRY_S)  # the next completed save, or the next look, retries
            return
        except (OSError, EOFError, TimeoutError) as error:
            log.debug("pushing step %d to %s: %s", step, successor, error)
            await asyncio.sleep(RETRY_S)
            return
        self._failing.clear()
        if (self.ring.number, successor) == self._acked_by:
            self.acked = [*self.acked, step][-MAX_ACKED:]
            self._unpublished = True  # published with the next read of the peers

    def _push_failed(self, cause: str, error: BaseException) -> None:
        """Said once per cause until a push succeeds again."""
        if cause not in self._failing:
            self._failing.add(cause)
            log.warning(
                "pushing the snapshots to the next node failed (%s): %s",
                cause,
                error,
                exc_info=cause == "push_error",
            )

    async def _push(self, successor: str | None, address: str, step: int) -> None:
        holder = self.holder
        assert successor is not None
        slots = []
        for rank in self.ring.ranks:  # marked before the first await: no newer save takes them
            held = holder.ledger.ranks().get(rank)
            index = held.complete(step, self.ring.world) if held is not None else None
            slot = held.slots[index] if held is not None and index is not None else None
            if index is None or slot is None:  # given to a newer save meanwhile: the next one
                return
            slots.append((rank, index, slot))
        for _, _, slot in slots:
            slot.sending = True
        try:
            files = [(rank, holder.slot_path(rank, index)) for rank, index, _ in slots]
            await push(self.key, self.node_id, successor, address, step, self.ring, files)
        finally:
            for _, _, slot in slots:
                slot.sending = False


def replication_for(
    config: ServeConfig,
    coordinator: Coordinator,
    events: EventLog,
    share: JobShare,
    publish: Callable[[], None],
) -> Callable[[CheckpointHolder], Replication] | None:
    """Replicas of the snapshots on the next node, for a job of several nodes with a memory tier
    and a secret to sign them with (unsigned, anyone who reaches the port could plant state):
    how to build them for the holder, which builds them with itself."""
    if not config.multi_node or config.checkpoint_memory_bytes == 0:
        return None
    key = coordinator.codec.replica_key() if coordinator.codec is not None else None
    if key is None:
        log.info(
            "snapshots are not replicated to a peer node: the job has no secret to sign them "
            "with (--rdzv-conf secret_file=PATH or FTD_RDZV_SECRET)"
        )
        return None

    def round_view() -> tuple[int, Sequence[str], range, int] | None:
        rnd = coordinator.round
        if rnd is None:
            return None
        first = rnd.base_global_rank
        ranks = range(first, first + rnd.nproc)
        # Where this node holds no list (a large round: assignment.py), its ring is itself and
        # its successor; node rank 0, which gathers the floor, holds the list.
        members = rnd.node_ids
        if members is None:
            members = (config.node_id, rnd.successor) if rnd.successor else (config.node_id,)
        return rnd.number, members, ranks, rnd.world_size

    def replication(holder: CheckpointHolder) -> Replication:
        return Replication(key, config.node_id, events, round_view, share, publish, holder)

    return replication
