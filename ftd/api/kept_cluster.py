"""`GET /v1/cluster` at thousands of nodes (issue 43): the read behind a page is every node's
summary from the rendezvous (O(N) at the node asked: 0.011 s at 1,024 nodes, 0.033 s at 4,096),
while a page is O(limit). So one read, with its aggregates (cluster_view.prepare), serves the
pages asked while it is young, and reading costs the daemon at most READ_SHARE of its time
however often pages come (a dashboard open in several browsers, a script polling).

`kept_view_step` decides, from the clock: a view read in `took_s` is fresh for
`took_s / READ_SHARE` (0.05 s where it took 1 ms, 1.65 s where it took 33 ms) and is served as
it is; up to twice that it is served while a new read starts beside it; older, of another
round, or dropped (this node changed the exclusions), a page waits for a read. One read at a
time: every page that waits shares it. Each page says how old its nodes' summaries are
(`view_age_s`).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any

from ftd.api.cluster_view import Prepared, page, prepare
from ftd.tasks import Background

READ_SHARE = 0.02
"""The share of the daemon's time that reading the view for pages may take."""


class Step(enum.Enum):
    SERVE = "serve"
    """The kept view, as it is."""
    SERVE_AND_READ = "serve_and_read"
    """The kept view, and a new read starts beside (unless one runs)."""
    READ = "read"
    """Wait for a read (or the one running)."""


@dataclass(frozen=True)
class Kept:
    prepared: Prepared
    read_at: float
    """When the read started (monotonic): its summaries are at least that recent."""
    took_s: float
    key: Hashable
    """What the view was read for (the round); another key makes it useless."""


def kept_view_step(now: float, kept: Kept | None, key: Hashable) -> Step:
    """What a page asked at `now`, for `key`, does with the view kept (pure)."""
    if kept is None or kept.key != key:
        return Step.READ
    fresh_s = kept.took_s / READ_SHARE
    age_s = now - kept.read_at
    if age_s <= fresh_s:
        return Step.SERVE
    return Step.SERVE_AND_READ if age_s <= 2 * fresh_s else Step.READ


class KeptClusterView:
    """The cluster view behind a node's pages (one per daemon)."""

    def __init__(
        self,
        read: Callable[[], Awaitable[dict[str, Any]]],
        background: Background,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`read`: the coordinator's cluster view (raises as it does: a page then fails)."""
        self._read = read
        self._background = background
        self._clock = clock
        self._kept: Kept | None = None
        self._reading: tuple[Hashable, asyncio.Task[Kept]] | None = None
        self._generation = 0
        """Counts drops: a read started before one is not kept."""
        self.reads = 0
        self.recent_reads_s: collections.deque[float] = collections.deque(maxlen=16)
        """How long the last reads took (what a page would cost without the kept view)."""

    def drop(self) -> None:
        """Forget the kept view (this node changed what it shows): the next page reads."""
        self._kept = None
        self._generation += 1
        self._reading = None

    async def page(self, key: Hashable, offset: int, limit: int) -> dict[str, Any]:
        """Nodes `offset` .. `offset + limit` and the aggregates, from a view read for `key`."""
        kept = self._kept
        step = kept_view_step(self._clock(), kept, key)
        if step is Step.READ or kept is None:
            kept = await asyncio.shield(self._start(key))
        elif step is Step.SERVE_AND_READ:
            self._start(key)
        answer = page(kept.prepared, offset, limit)
        answer["view_age_s"] = round(max(0.0, self._clock() - kept.read_at), 3)
        return answer

    def _start(self, key: Hashable) -> asyncio.Task[Kept]:
        if self._reading is not None:
            reading_for, reading = self._reading
            if not reading.done() and reading_for == key:
                return reading
            if reading_for != key:
                self.drop()  # a read for another round is no page's answer now
        reading = self._background.adopt(self._read_for(key), "cluster-view-read")
        self._reading = (key, reading)
        return reading

    async def _read_for(self, key: Hashable) -> Kept:
        generation, started = self._generation, self._clock()
        view = await self._read()
        kept = Kept(prepare(view), started, self._clock() - started, key)
        self.reads += 1
        self.recent_reads_s.append(kept.took_s)
        if generation == self._generation:
            self._kept = kept
        return kept
