"""What a node knows of the round for its replicas (replication.py): the members, its ranks,
and the peers' replica servers and replicated steps as their signed node summaries say.

A summary is read from the rendezvous store, so it may be an old one played back: one older
than the newest read of its node (its `time`) is refused (`stale_summary`), as is one whose
`replica_addr` is not `host:port` (`bad_address`); either is counted, said once per node and
cause, and changes nothing. A squatter on an old summary's port gets nothing either way: the
handshake (replica_wire.py) wants the job's key and the node's id before a byte is pushed.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ftd.checkpoint.replica_wire import parse_address
from ftd.refusals import Refusals

log = logging.getLogger("ftd.checkpoint")


def newest_common(lists: Sequence[Iterable[int]]) -> int | None:
    """The newest step in every list, or None."""
    common = set.intersection(*(set(steps) for steps in lists)) if lists else set()
    return max(common) if common else None


class Ring:
    """What this node knows of the round: its ranks and the peers' replica servers."""

    def __init__(self, refused: Refusals) -> None:
        self.number = 0
        self._members: Sequence[str] = ()
        self._member_set: frozenset[str] = frozenset()
        self._ring: list[str] = []
        """The members in ring order (sorted), kept while the round's list is the same."""
        self.ranks: range = range(0)
        self.world = 0
        self.addresses: dict[str, str] = {}
        self.replicated: dict[str, tuple[int, ...]] = {}
        self.refused = refused
        self._newest: dict[str, float] = {}
        """The newest summary's time read of each node."""
        self._said: set[tuple[str, str]] = set()

    @property
    def members(self) -> Sequence[str]:
        return self._members

    @members.setter
    def members(self, members: Sequence[str]) -> None:
        # Every look sets it (every 2 s on every node): sorted again only for a new round's.
        if members is not self._members:
            self._members = members
            self._member_set = frozenset(members)
            self._ring = sorted(self._member_set)

    def successor(self, me: str) -> str | None:
        ring = self._ring
        if me not in self._member_set or len(ring) < 2:
            return None
        return ring[(bisect.bisect_left(ring, me) + 1) % len(ring)]

    @property
    def in_order(self) -> list[str]:
        return self._ring

    def read(self, nodes: Iterable[Any]) -> None:
        """The members' summaries (`GET /v1/cluster`'s nodes): their servers, their steps."""
        for node in nodes:
            if not isinstance(node, dict) or node.get("node_id") not in self._member_set:
                continue
            node_id: str = node["node_id"]
            stamp = node.get("time")
            if not isinstance(stamp, int | float) or stamp < self._newest.get(node_id, stamp):
                self._refuse(node_id, "stale_summary", f"a summary of time {stamp!r}")
                continue
            address = node.get("replica_addr")
            if address is not None and parse_address(address) is None:
                self._refuse(node_id, "bad_address", f"replica_addr {str(address)[:80]!r}")
                continue
            self._newest[node_id] = stamp
            if address is not None:
                self.addresses[node_id] = address
            this_round = node.get("replicated_round") == self.number
            steps = node.get("replicated_steps", ()) if this_round else ()
            self.replicated[node_id] = tuple(steps)

    def _refuse(self, node_id: str, cause: str, detail: str) -> None:
        self.refused[cause] += 1
        if (node_id, cause) not in self._said:
            self._said.add((node_id, cause))
            log.warning("refused node %s's summary (%s): %s", node_id, cause, detail)


def floor_record(ring: Ring, wall: float) -> dict[str, Any]:
    """The replica floor's aggregate (records.ReplicaFloor) of what `ring` read of every member:
    node rank 0's, for every node to take its own `keep_from` out of (floor_for)."""
    second_newest: list[tuple[int, str]] = []
    short: list[str] = []
    for node in ring.in_order:
        steps = sorted(ring.replicated.get(node, ()))
        if len(steps) < 2:
            short.append(node)
        else:
            second_newest.append((steps[-2], node))
    second_newest.sort()
    return {
        "round": ring.number,
        "time": wall,
        "lowest": tuple({"node_id": node, "step": step} for step, node in second_newest[:2]),
        "short": tuple(short[:2]),
    }


def floor_for(record: Mapping[str, Any] | None, me: str) -> int | None:
    """Node `me`'s `keep_from` from a replica floor's aggregate: ledger.replica_floor over the
    other nodes' steps (None, keep everything, without an aggregate of this round)."""
    if record is None or any(node != me for node in record.get("short", ())):
        return None
    steps = [entry["step"] for entry in record.get("lowest", ()) if entry.get("node_id") != me]
    return min(steps) if steps else None
