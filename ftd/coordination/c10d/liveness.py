"""Node liveness: is a member still beating? A pure verdict and the loop that applies it.

Every daemon writes a signed keepalive record with a growing sequence number; node rank 0 reads
every member's, the others read node rank 0's (O(N) reads per interval for the cluster). A
member whose sequence has not grown for --node-keepalive-timeout, as measured by a reader that
was itself reading all along, is dead. A reader whose own reads were late (its CPUs saturated
by training, the daemon stopped for a while) cannot tell who was silent: it restarts the clock
for everyone instead of declaring anyone dead. A replayed older record, a forged one, or a
missing one is no beat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ftd.coordination.c10d.record_store import RecordStore, StoreThread
from ftd.coordination.records import AliveRecord
from ftd.tasks import within
from ftd.tcpstore.client import StoreGone

log = logging.getLogger("ftd.coordination.liveness")

BEATS_PER_TIMEOUT = 3
"""A node beats (and reads) this many times per --node-keepalive-timeout: with a reader's
read and its own write, 6/K store operations a node per second (issue 43's budget of 2 at
K = 5 s has room for the rest); a reader whose reads were two intervals apart was stalled."""
KEEPALIVE_OP_MIN_TIMEOUT_S = 5.0
"""A keepalive call slower than this (and than twice the timeout) means the store is gone."""


@dataclass(frozen=True)
class Beat:
    """What a reader last saw of a node: its sequence, and since when (reader's clock)."""

    seq: int | None
    since: float
    done: bool = False


def judge(
    seen: Mapping[str, Beat],
    beats: Mapping[str, AliveRecord | None],
    now: float,
    last_read_at: float | None,
    timeout_s: float,
) -> tuple[dict[str, Beat], list[tuple[str, str]]]:
    """The readers' new view and the nodes now dead, each with its reason."""
    stalled = last_read_at is not None and now - last_read_at > 2 * timeout_s / BEATS_PER_TIMEOUT
    updated: dict[str, Beat] = {}
    dead: list[tuple[str, str]] = []
    for node, previous in seen.items():
        beat = beats.get(node)
        if previous.done or (beat is not None and beat.done):
            updated[node] = Beat(previous.seq, now, done=True)  # finished: not dead
            continue
        if beat is not None and (previous.seq is None or beat.seq > previous.seq):
            updated[node] = Beat(beat.seq, now)
            continue
        since = now if stalled else previous.since
        updated[node] = Beat(previous.seq, since)
        if now - since > timeout_s:
            dead.append(
                (
                    node,
                    f"node {node} lost: no keepalive for {now - since:.1f}s "
                    f"(--node-keepalive-timeout {timeout_s:g}s)",
                )
            )
    return updated, dead


def alive_key(node_id: str) -> str:
    return f"alive/{node_id}"


class Keepalive:
    """Beats for this node and watches others; reports dead nodes once each, and a lost store."""

    def __init__(
        self,
        node_id: str,
        store: RecordStore,
        thread: StoreThread,
        timeout_s: float,
        on_dead: Callable[[str, str], None],
        on_lost: Callable[[str], None],
    ) -> None:
        self.node_id = node_id
        self.timeout_s = timeout_s
        self.interval_s = max(timeout_s / BEATS_PER_TIMEOUT, 0.05)
        self.done = False
        self._store = store
        self._thread = thread
        self._on_dead = on_dead
        self._on_lost = on_lost
        self._seen: dict[str, Beat] = {}
        self._declared: set[str] = set()
        self._seq = time.time_ns() // 1000  # a restarted daemon's sequence is still higher
        self._stopped = asyncio.Event()
        self._last_read_at: float | None = None
        self._generation = 0

    def watch(self, nodes: list[str]) -> None:
        """Watch these nodes from now on (a new round)."""
        now = time.monotonic()
        self._seen = {node: Beat(None, now) for node in nodes if node != self.node_id}
        self._generation += 1
        self._declared = set()
        self._last_read_at = None

    def beat_now(self) -> None:
        """Blocking: one beat (at start, so others see this node before its first round)."""
        self._seq += 1
        self._store.put(alive_key(self.node_id), AliveRecord(seq=self._seq, done=self.done))

    def _beat_and_read(self, watched: list[str]) -> dict[str, AliveRecord | None]:
        self.beat_now()
        found = self._store.read_many([alive_key(n) for n in watched], AliveRecord)
        return {node: found.get(alive_key(node)) for node in watched}

    def stop(self) -> None:
        self._stopped.set()

    async def run(self) -> None:
        limit = max(2 * self.timeout_s, KEEPALIVE_OP_MIN_TIMEOUT_S)
        while not self._stopped.is_set():
            watched, generation = list(self._seen), self._generation
            try:
                beats = await within(self._thread.submit(self._beat_and_read, watched), limit)
            except (StoreGone, TimeoutError) as error:
                if not self._stopped.is_set():
                    self._on_lost(f"keepalive failed: {type(error).__name__}: {error}"[:300])
                return
            if generation != self._generation:  # a new round began meanwhile
                continue
            now = time.monotonic()
            current = {node: self._seen[node] for node in watched}
            updated, dead = judge(current, beats, now, self._last_read_at, self.timeout_s)
            self._seen.update(updated)
            self._last_read_at = now
            for node, reason in dead:
                if node not in self._declared and node in self._seen:
                    self._declared.add(node)
                    log.error("%s", reason)
                    self._on_dead(node, reason)
            with contextlib.suppress(TimeoutError):  # periodic by nature; a stop wakes it
                await within(self._stopped.wait(), self.interval_s)
