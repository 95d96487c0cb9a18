"""The job's ranks' times per step, shared without every node reading every node (issue 43).

Each node publishes its own ranks' times in its summary (straggler_timer.py). Reading every
other node's summary on every node is N² reads of the store per look; instead the round's node
rank 0 reads them (N) and writes the job's times once, as one bounded record (JobTimes: at most
MAX_PUBLISHED_RANKS ranks, an even sample by forward time beyond, which keeps the median), and
every other node reads that one record: O(1) per node per look, O(N) in all.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ftd.coordination.job_share import JobShare
from ftd.coordination.records import MAX_PUBLISHED_RANKS
from ftd.health.stragglers import SIGNALS, Signal

log = logging.getLogger("ftd.health")

Times = dict[Signal, dict[int, float]]
WIRE: dict[Signal, str] = {"forward": "forward_us", "host": "host_us"}
"""Each signal's field in a published RankForward."""
ROW_COLUMNS: dict[Signal, int] = {"forward": 1, "host": 2}
"""Each signal's place in a JobTimes ForwardRow."""
MAX_PEER_RANKS = 65536
"""The job's times are taken from at most this many of the nodes' published ranks."""


def node_times(cluster: Mapping[str, Any], skip_node: str | None = None) -> Times:
    """Each signal -> global rank -> seconds, of the ranks in the nodes' summaries of a
    `GET /v1/cluster` answer (records the coordinator decoded and verified; anything else in it
    is skipped), but `skip_node`'s."""
    times: Times = {signal: {} for signal in SIGNALS}
    nodes = cluster.get("nodes")
    read = 0
    for node in nodes if isinstance(nodes, list) else ():
        if not isinstance(node, dict) or node.get("node_id") == skip_node:
            continue
        entries = node.get("forward")
        for entry in entries if isinstance(entries, list | tuple) else ():
            read += 1
            if read > MAX_PEER_RANKS:
                return times
            take(times, entry)
    return times


def take(times: Times, entry: object) -> None:
    """One published RankForward (checked or not) into `times`; anything else is skipped."""
    rank = entry.get("global_rank") if isinstance(entry, dict) else None
    for signal, wire in WIRE.items():
        micros = entry.get(wire) if isinstance(entry, dict) else None
        if type(rank) is int and type(micros) is int and rank >= 0 and micros >= 0:
            times[signal].setdefault(rank, micros / 1e6)


def sampled(times: Times, most: int = MAX_PUBLISHED_RANKS) -> list[int]:
    """The ranks a JobTimes record carries: every one up to `most`, else `most` of them evenly
    spaced in the order of their forward (else host) times, so the sample's median is the
    job's, give or take one step of the sample."""
    ranks = sorted({rank for signal in SIGNALS for rank in times[signal]})
    if len(ranks) <= most:
        return ranks
    key = times["forward"] if times["forward"] else times["host"]
    ordered = sorted(ranks, key=lambda rank: (key.get(rank, float("inf")), rank))
    step = (len(ordered) - 1) / (most - 1)
    return sorted({ordered[round(i * step)] for i in range(most)})


def forward_entries(
    times: Mapping[Signal, Mapping[int, float]], ranks: list[int]
) -> tuple[dict[str, int], ...]:
    """`ranks`' published RankForward entries (a tuple: the records' strict fields take no
    lists), each with the signals it has a time of."""
    return tuple(
        {"global_rank": r, **{WIRE[s]: round(t[r] * 1e6) for s, t in times.items() if r in t}}
        for r in ranks
    )


def job_record(number: int, wall: float, times: Times) -> dict[str, Any]:
    """The JobTimes record of round `number` for `times`: a ForwardRow per rank sampled."""
    forward, host = times["forward"], times["host"]
    rows = tuple((r, _micros(forward.get(r)), _micros(host.get(r))) for r in sampled(times))
    return {"round": number, "time": wall, "forward": rows}


def _micros(seconds: float | None) -> int | None:
    return round(seconds * 1e6) if seconds is not None else None


def times_of(rows: Sequence[Sequence[int | None]]) -> Times:
    """The times in a JobTimes record's rows (validated ForwardRows: rank, forward and host
    microseconds)."""
    times: Times = {signal: {} for signal in SIGNALS}
    for signal, column in ROW_COLUMNS.items():
        seconds = times[signal]
        for row in rows:
            rank, micros = row[0], row[column]
            if rank is not None and micros is not None:
                seconds.setdefault(rank, micros / 1e6)
    return times


class JobTimesShare:
    """How a node learns the job's times: as the round's node rank 0, from every summary
    (and it writes them for the others); else from that one record."""

    def __init__(self, share: JobShare) -> None:
        self._share = share

    async def read(self, wall: float) -> Times | None:
        """The job's times now (None: nothing to read yet, the last view stays)."""
        rnd = self._share.round
        if rnd is None:
            return None
        if self._share.leading():
            gathered = node_times({"nodes": await self._share.every_summary()})
            await self._share.publish("job_times", job_record(rnd.number, wall, gathered))
            return gathered
        record = await self._share.read("job_times")
        if record is None:
            return None  # node rank 0 has not written this round's yet
        return times_of(record.get("forward", ()))
