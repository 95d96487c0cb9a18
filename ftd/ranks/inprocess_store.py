"""In-process restart: one attempt's round keys as a node's daemon reads and writes them.

The keys and records are ftd_client/inprocess/keys.py's, shared with the ranks. Every method
of `InprocessStore` blocks, so InprocessRounds (ftd/ranks/inprocess.py) runs each in a thread: the
short operations on this node's connection, the leader's two long waits (`gather`, a round's
barrier; `await_fault`, its fault) on connections of their own, in chunks of IDLE_WAIT_S so
that closing is noticed.

Races between a death and a decision are closed by writing, then reading what the other side
writes: the exit handler writes the arrival off (`write_off`), then reads the members; the
leader writes the members (`publish`), then reads the arrivals again. Whichever comes second
sees the other and announces.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from ftd_client.inprocess.keys import (
    DAEMON,
    DEAD,
    FAULT,
    STOP,
    Arrival,
    Fault,
    Forged,
    Keys,
    Members,
    Seal,
    claim_fault,
    valid_fault,
)

from ftd.ranks.workers_store import STORE_OP_TIMEOUT_S
from ftd.refusals import Refusals
from ftd.tcpstore.client import StoreClient, StoreTimeout

log = logging.getLogger("ftd.inprocess")

IDLE_WAIT_S = 3600.0
"""A wait without a deadline is cut into waits this long (closing wakes it at once)."""


def connect(host: str, port: int, timeout_s: float = STORE_OP_TIMEOUT_S) -> StoreClient:
    """Blocking: a connection of the daemon's own (ftd's client: the daemon imports no torch)."""
    return StoreClient(host, port, timeout_s)


@dataclass(frozen=True)
class Arrivals:
    """Who reached a round's barrier: live slots with their arrival, and written-off slots."""

    live: dict[int, Arrival]
    raw: dict[int, bytes]

    @classmethod
    def read(
        cls, slots: Sequence[int], values: Sequence[bytes], payloads: Sequence[bytes]
    ) -> Arrivals:
        """`values` as stored (sealed), `payloads` unsealed."""
        raw = dict(zip(slots, values, strict=True))
        live = {
            slot: Arrival.decode(payload)
            for slot, payload in zip(slots, payloads, strict=True)
            if payload != DEAD
        }
        return cls(live, raw)

    @property
    def hard_timeout_s(self) -> float:
        """The longest hard timeout the live ranks announced (their Wrappers may differ)."""
        return max((a.hard_timeout_s for a in self.live.values()), default=STORE_OP_TIMEOUT_S)


def missing(expected: Sequence[int], present: Sequence[bool]) -> list[int]:
    return [slot for slot, there in zip(expected, present, strict=True) if not there]


class InprocessStore:
    """One attempt's round keys under `keys`, read and written by blocking calls."""

    def __init__(
        self,
        store_addr: tuple[str, int],
        keys: Keys,
        world_size: int,
        by: str,
        closing: threading.Event,
        seal: Seal | None = None,
    ) -> None:
        self.store_addr = store_addr
        self.keys = keys
        self.world = list(range(world_size))
        self.by = by
        """Who announces this node's faults and decisions (`daemon <node id>`)."""
        self.closing = closing
        """Set once the rounds close (by InprocessRounds): the waits leave."""
        self.round = 0
        """The newest round this node has seen opened (the leader's is the truth)."""
        self.seal = seal or Seal()
        """Seals this attempt's records when the job has a secret (keys.py)."""
        self.refused: collections.Counter[str] = Refusals("inprocess_store")
        """Values that failed to unseal, by key kind: stepped over, never acted on."""
        self._logged: set[str] = set()
        self._store: StoreClient | None = None

    def _refuse(self, kind: str, error: Forged) -> None:
        self.refused[kind] += 1
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(
                "in-process: ignored a %s record (%s); further ones are counted", kind, error
            )

    def _unsealed(self, kind: str, key: str, value: bytes) -> bytes | None:
        try:
            return self.seal.unseal(key, value)
        except Forged as error:
            self._refuse(kind, error)
            return None

    # -- this node's connection --------------------------------------------------------------

    def connect(self) -> None:
        """Blocking: open the connection of the short operations."""
        host, port = self.store_addr
        self._store = connect(host, port)

    def disconnect(self) -> None:
        """Blocking: close that connection."""
        store, self._store = self._store, None
        if store is not None:
            store.close()

    @property
    def connected(self) -> bool:
        return self._store is not None

    @property
    def store(self) -> StoreClient:
        assert self._store is not None
        return self._store

    # -- every node: a local rank failed -----------------------------------------------------

    def rounds_completed(self) -> bool:
        """Whether the open round ended with every member's function returned."""
        store, keys = self.store, self.keys
        rnd = int(store.get(keys.open))
        if not store.check([keys.fault(rnd)]):
            return False
        payload = self._unsealed("fault", keys.fault(rnd), store.get(keys.fault(rnd)))
        return payload is not None and Fault.decode(payload).completed

    def write_off(self, slot: int, respawn: bool, reason: str) -> tuple[int, bool]:
        """Take the slot's arrival out of the open round and the next (survivors may be a
        round ahead of `open`); announce a fault to the rounds it is a member of. Without a
        respawn the slot is written off for good. Returns (open round, whether announced)."""
        store, keys = self.store, self.keys
        if not respawn:
            n = store.add(keys.dead_count, 1)
            store.set(keys.dead(n), self.seal.seal(keys.dead(n), str(slot).encode()))
        rnd = int(store.get(keys.open))
        self.round = max(self.round, rnd)
        rounds = (rnd, rnd + 1)
        for k in rounds:
            if respawn:
                store.delete_key(keys.arrive(k, slot))
            else:
                store.set(keys.arrive(k, slot), self.seal.seal(keys.arrive(k, slot), DEAD))
        if not respawn:
            store.queue_push(keys.barrier, f"{rnd}:{slot}")
        announced = False
        for k in rounds:
            if not store.check([keys.members(k)]):
                continue
            payload = self._unsealed("members", keys.members(k), store.get(keys.members(k)))
            if payload is not None and slot in Members.decode(payload).slots:
                fault = Fault.now("rank_exit", slot, reason, k, self.by)
                self.announce(store, k, fault)
                announced = True
        return rnd, announced

    def announce(self, store: StoreClient, rnd: int, fault: Fault) -> Fault:
        """Round `rnd`'s fault is `fault` unless one was written first; wake every watcher."""
        stored = claim_fault(store, self.seal, self.keys.fault(rnd), fault)
        watchers: list[int | str] = [*self.world, DAEMON]
        wake = [self.keys.wake(rnd, who) for who in watchers]
        store.multi_set(wake, [FAULT.decode()] * len(wake))
        return stored

    # -- the leader: the rounds --------------------------------------------------------------

    def open_first(self) -> None:
        """Open round 0, before the first barrier."""
        self.store.set(self.keys.open, "0")

    def open(self, rnd: int) -> None:
        """Open round `rnd` (respawned ranks join it), and write the slots off that were
        written off for good (read after `open` is written: see write_off)."""
        store, keys = self.store, self.keys
        store.set(keys.open, str(rnd))
        self.round = rnd
        count = int(store.add(keys.dead_count, 0))
        if count:
            names = [keys.dead(n) for n in range(1, count + 1)]
            found = [
                self._unsealed("dead slot", k, v)
                for k, v in zip(names, store.multi_get(names), strict=True)
            ]
            dead = [int(v) for v in found if v is not None]
            arrive = [keys.arrive(rnd, slot) for slot in dead]
            if arrive:
                store.multi_set(arrive, [self.seal.seal(k, DEAD) for k in arrive])

    def gather(self, store: StoreClient, rnd: int, deadline: float | None) -> Arrivals | list[int]:
        """The arrivals at round `rnd`'s barrier once every slot is there; at the deadline, the
        slots missing instead. Woken by the barrier queue (keys.py), not polled."""
        keys = [self.keys.arrive(rnd, slot) for slot in self.world]
        while not self.closing.is_set():
            if store.check(keys):
                values = store.multi_get(keys)
                payloads = [
                    self._unsealed("arrival", k, v) for k, v in zip(keys, values, strict=True)
                ]
                if all(p is not None for p in payloads):
                    return Arrivals.read(self.world, values, [p or b"" for p in payloads])
                for key, payload in zip(keys, payloads, strict=True):
                    if payload is None:  # the rank's own arrival, if any, is written again
                        store.delete_key(key)
                continue
            left_s = IDLE_WAIT_S if deadline is None else deadline - time.monotonic()
            if left_s <= 0:
                return missing(self.world, [store.check([key]) for key in keys])
            store.set_timeout(timedelta(seconds=left_s))
            with contextlib.suppress(StoreTimeout):  # the deadline: checked above
                store.queue_pop(self.keys.barrier, True)
        return []

    def publish(self, rnd: int, members: Members, arrivals: Arrivals) -> list[int]:
        """Write the members, then read the arrivals again; a member whose process died
        meanwhile ends the round at once. The slots that changed."""
        store, keys = self.store, self.keys
        store.set(keys.members(rnd), self.seal.seal(keys.members(rnd), members.encode()))
        arrive = [keys.arrive(rnd, slot) for slot in members.slots]
        present = [store.check([key]) for key in arrive]
        changed = missing(members.slots, present)
        there = [slot for slot, ok in zip(members.slots, present, strict=True) if ok]
        if there:
            now = store.multi_get([keys.arrive(rnd, slot) for slot in there])
            changed += [s for s, v in zip(there, now, strict=True) if v != arrivals.raw[s]]
        if changed:
            reason = f"ranks {sorted(changed)} left while round {rnd} was decided"
            self.announce(store, rnd, Fault.now("rank_exit", changed[0], reason, rnd, self.by))
        return changed

    def await_fault(self, store: StoreClient, rnd: int) -> Fault | None:
        """Round `rnd`'s fault once announced; None when the watch was stopped or the round
        ended well (no round follows)."""
        key = self.keys.wake(rnd, DAEMON)
        fault: Fault | None = None
        while fault is None:
            while not store.waited([key], IDLE_WAIT_S):
                if self.closing.is_set():
                    return None
            if store.get(key) == STOP or self.closing.is_set():
                return None
            fault = valid_fault(store, self.seal, self.keys.fault(rnd), key)
            if fault is None:
                self._refuse(
                    "fault", Forged(f"{self.keys.fault(rnd)}: forged, or a wake without one")
                )
        if fault.completed:
            log.info("in-process round %d: every member's function returned", rnd)
            return None
        return fault

    def stop_waits(self, rnd: int) -> None:
        """Wake the leader's waits (they find the rounds closing)."""
        self.store.compare_set(self.keys.wake(rnd, DAEMON), "", STOP)
        self.store.queue_push(self.keys.barrier, "close")
