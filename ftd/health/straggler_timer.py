"""Stragglers on the event loop: a look every STRAGGLER_TICK_S, the job's times per step (forward
and host: stragglers.py) from the other nodes' published summaries, and this node's in its own.

Across nodes the job's medians need every node's ranks: each node publishes its ranks' times
(and its stragglers) in its summary, the signed, bounded `status/<node>` record behind
`GET /v1/cluster` (ftd/coordination/records.py: NodeSummary.forward, .stragglers); every
PEERS_READ_S, while its own ranks report times, it reads the job's as node rank 0 gathered them
into one record (job_times.py: O(1) reads per node, not every node's summary).
Each node judges only its own ranks (one event per straggler, from the node that runs it); the
cluster view lists every node's.

A summary is published when a straggler appears or clears, and when a time moved by more than
PUBLISH_CHANGE, at most every PUBLISH_S: a steady job writes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from ftd import containment
from ftd.health.job_times import MAX_PEER_RANKS as MAX_PEER_RANKS
from ftd.health.job_times import JobTimesShare, forward_entries, node_times
from ftd.health.progress import ProgressWatch
from ftd.health.stragglers import Signal, StragglerChange
from ftd.status.event_kind import EventKind
from ftd.status.events import EventLog
from ftd.tasks import Background, within

log = logging.getLogger("ftd.health")

STRAGGLER_TICK_S = 1.0
PEERS_READ_S = 5.0
PUBLISH_S = 5.0
PUBLISH_CHANGE = 0.05
MAX_PUBLISHED = 512
"""As records.MAX_PUBLISHED_RANKS: what a node's summary carries."""


def peer_times(cluster: Mapping[str, Any], node_id: str) -> dict[Signal, dict[int, float]]:
    """Each signal -> global rank -> seconds, of the other nodes' ranks in a `GET /v1/cluster`
    answer (job_times.node_times without `node_id`'s)."""
    return node_times(cluster, node_id)


def peer_forward(cluster: Mapping[str, Any], node_id: str) -> dict[int, float]:
    """Global rank -> forward seconds of the other nodes' ranks (peer_times' forward)."""
    return peer_times(cluster, node_id)["forward"]


def moved(before: Mapping[int, float], now: Mapping[int, float]) -> bool:
    """Whether the times changed enough to be published again."""
    if before.keys() != now.keys():
        return True
    return any(abs(now[r] - before[r]) > PUBLISH_CHANGE * max(before[r], 1e-6) for r in now)


class StragglerTimer:
    def __init__(
        self,
        watch: ProgressWatch,
        events: EventLog,
        node_id: str,
        share: JobTimesShare | None = None,
        publish: Callable[[], None] | None = None,
    ) -> None:
        """`share` reads the job's times and `publish` sends this node's summary: both None on
        a single node."""
        self.watch = watch
        self._events = events
        self._node_id = node_id
        self._share = share
        self._publish = publish
        self._peers: dict[Signal, dict[int, float]] = {}
        self._published: dict[Signal, dict[int, float]] = {}
        self._published_at = float("-inf")
        self._background = Background()

    def start(self) -> None:
        self._background.spawn(self._run(), "stragglers")

    def close(self) -> None:
        self._background.cancel()

    def summary(self) -> dict[str, Any]:
        """This node's part of its published summary (NodeSummary.forward, .stragglers)."""
        times = self.watch.times()
        ranks = sorted({rank for own in times.values() for rank in own})[:MAX_PUBLISHED]
        return {
            "forward": forward_entries(times, ranks),
            "stragglers": tuple(self.watch.stragglers.listed()[:MAX_PUBLISHED]),
        }

    async def _run(self) -> None:
        read_at = float("-inf")
        while True:
            await asyncio.sleep(STRAGGLER_TICK_S)
            if (
                self._share is not None
                and time.monotonic() - read_at >= PEERS_READ_S
                and any(self.watch.times().values())  # nothing to judge, nothing to read
            ):
                read_at = time.monotonic()
                await self._read_peers(self._share)
            containment.call("stragglers", self.tick, time.monotonic(), time.time())

    async def _read_peers(self, share: JobTimesShare) -> None:
        try:
            times = await within(share.read(time.time()), PEERS_READ_S * 2)
        except Exception as error:  # the last view is kept; the next read tries again
            log.debug("cannot read the job's forward times: %s", error)
            return
        if times is not None:
            self._peers = times

    def tick(self, now: float, wall: float) -> list[StragglerChange]:
        own = self.watch.times()
        changes = self.watch.stragglers.check(now, wall, own, self._peers)
        for change in changes:
            self._emit(change)
        if self._publish is not None and (
            changes or (now - self._published_at >= PUBLISH_S and self._moved(own))
        ):
            self._published, self._published_at = own, now
            self._publish()
        return changes

    def _moved(self, own: dict[Signal, dict[int, float]]) -> bool:
        return any(moved(self._published.get(s, {}), own[s]) for s in own)

    def _emit(self, change: StragglerChange) -> None:
        straggler = change.straggler
        data: dict[str, Any] = {
            "global_rank": straggler.global_rank,
            "node_id": self._node_id,
            "ratio": straggler.ratio,
            "since": round(straggler.since, 3),
            "signal": straggler.signal,
            f"{straggler.signal}_s": change.seconds,
            "median_s": change.median_s,
            "reason": change.reason,
        }
        if change.kind == "straggler":  # the event first: whoever reads the line finds it
            self._events.emit(EventKind.STRAGGLER, **data)
            log.warning("straggler: %s", change.reason)
        else:
            self._events.emit(EventKind.STRAGGLER_CLEARED, **data)
            log.info("straggler cleared: %s", change.reason)
