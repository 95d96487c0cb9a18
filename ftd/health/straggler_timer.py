"""Stragglers on the event loop: a look every STRAGGLER_TICK_S, the job's times per step (forward
and host: stragglers.py) from the other nodes' published summaries, and this node's in its own.

Across nodes the job's medians need every node's ranks: each node publishes its ranks' times
(and its stragglers) in its summary, the signed, bounded `status/<node>` record behind
`GET /v1/cluster` (ftd/coordination/records.py: NodeSummary.forward, .stragglers), and reads
the others' every PEERS_READ_S through the same path while its own ranks report times.
Each node judges only its own ranks (one event per straggler, from the node that runs it); the
cluster view lists every node's.

A summary is published when a straggler appears or clears, and when a time moved by more than
PUBLISH_CHANGE, at most every PUBLISH_S: a steady job writes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ftd import containment
from ftd.health.progress import ProgressWatch
from ftd.health.stragglers import SIGNALS, Signal, StragglerChange
from ftd.status.event_kind import EventKind
from ftd.status.events import EventLog
from ftd.tasks import Background, within

log = logging.getLogger("ftd.health")

STRAGGLER_TICK_S = 1.0
PEERS_READ_S = 5.0
PUBLISH_S = 5.0
PUBLISH_CHANGE = 0.05
MAX_PEER_RANKS = 65536
"""The job's median is taken over at most this many of the other nodes' ranks."""
MAX_PUBLISHED = 512
"""As records.MAX_PUBLISHED_RANKS: what a node's summary carries."""


WIRE: dict[Signal, str] = {"forward": "forward_us", "host": "host_us"}
"""Each signal's field in a published RankForward."""


def peer_times(cluster: Mapping[str, Any], node_id: str) -> dict[Signal, dict[int, float]]:
    """Each signal -> global rank -> seconds, of the other nodes' ranks in a `GET /v1/cluster`
    answer (summaries the coordinator decoded and verified; anything else in it is skipped)."""
    times: dict[Signal, dict[int, float]] = {signal: {} for signal in SIGNALS}
    nodes = cluster.get("nodes")
    read = 0
    for node in nodes if isinstance(nodes, list) else ():
        if not isinstance(node, dict) or node.get("node_id") == node_id:
            continue
        entries = node.get("forward")
        for entry in entries if isinstance(entries, list | tuple) else ():
            read += 1
            if read > MAX_PEER_RANKS:
                return times
            rank = entry.get("global_rank") if isinstance(entry, dict) else None
            for signal, wire in WIRE.items():
                micros = entry.get(wire) if isinstance(entry, dict) else None
                if type(rank) is int and type(micros) is int and rank >= 0 and micros >= 0:
                    times[signal].setdefault(rank, micros / 1e6)
    return times


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
        cluster: Callable[[], Awaitable[dict[str, Any]]] | None = None,
        publish: Callable[[], None] | None = None,
    ) -> None:
        """`cluster` reads the other nodes' summaries (GET /v1/cluster's answer) and
        `publish` sends this node's: both None on a single node."""
        self.watch = watch
        self._events = events
        self._node_id = node_id
        self._cluster = cluster
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
        return {  # tuples: the record's strict fields take no lists
            "forward": tuple(
                {
                    "global_rank": r,
                    **{WIRE[s]: round(t[r] * 1e6) for s, t in times.items() if r in t},
                }
                for r in ranks
            ),
            "stragglers": tuple(self.watch.stragglers.listed()[:MAX_PUBLISHED]),
        }

    async def _run(self) -> None:
        read_at = float("-inf")
        while True:
            await asyncio.sleep(STRAGGLER_TICK_S)
            if (
                self._cluster is not None
                and time.monotonic() - read_at >= PEERS_READ_S
                and any(self.watch.times().values())  # nothing to judge, nothing to read
            ):
                read_at = time.monotonic()
                await self._read_peers(self._cluster)
            containment.call("stragglers", self.tick, time.monotonic(), time.time())

    async def _read_peers(self, cluster: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        try:
            answer = await within(cluster(), PEERS_READ_S * 2)
            self._peers = peer_times(answer, self._node_id)
        except Exception as error:  # the last view is kept; the next read tries again
            log.debug("cannot read the other nodes' forward times: %s", error)

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
