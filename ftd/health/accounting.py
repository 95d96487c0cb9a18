"""What the rank socket could not carry, and what ranks were refused: said once, counted.

LossWatch: messages a rank sent that never reached the daemon (gaps in its sequence numbers)
come in episodes — a burst, a daemon paused for a moment. The first loss of an episode is a
warning naming the rank and its message rate, and a `messages_lost` event; the episode ends
after EPISODE_QUIET_S without a loss. It also measures each rank's peak message rate, from
which the next attempt's send buffers are sized (launch.py).

BudgetWatch: refusals by a budget (rank_sync.py), a `budget_exceeded` event once per rank and
budget per attempt, every refusal counted.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

from ftd.health.links import RankHealth
from ftd.health.sync import BudgetExceeded
from ftd.status.event_kind import EventKind
from ftd.status.events import EventLog

log = logging.getLogger("ftd.health")

EPISODE_QUIET_S = 10.0
RATE_WINDOW_S = 1.0
PACKET_COST_BYTES = 1024
"""What the kernel charges a small packet against its sender's buffer (skb truesize: ~770 B for
a heartbeat; measured in bench/HEALTH.md)."""
STALL_BUDGET_S = 3.0
"""A rank's queue holds this long of its peak rate: a daemon paused for 3 s loses nothing."""
MIN_QUEUED_MESSAGES = 4096
NODE_QUEUE_BYTES = 256 * 2**20
"""All local ranks' queues together: the memory a node lends to waiting messages."""
WMEM_MAX = "/proc/sys/net/core/wmem_max"


def send_buffer_bytes(local_ranks: int, peak_rate: float, kernel_max: int | None = None) -> int:
    """A rank's send buffer: room for STALL_BUDGET_S of the peak rate seen (at least
    MIN_QUEUED_MESSAGES), within its share of NODE_QUEUE_BYTES and the kernel's wmem_max."""
    if kernel_max is None:
        kernel_max = _kernel_max()
    wanted = max(float(MIN_QUEUED_MESSAGES), peak_rate * STALL_BUDGET_S) * PACKET_COST_BYTES
    share = NODE_QUEUE_BYTES // max(local_ranks, 1)
    return int(min(wanted, share, kernel_max))


def _kernel_max() -> int:
    try:
        with open(WMEM_MAX, encoding="ascii") as file:
            return max(int(file.read(32).strip()), 4096)
    except (OSError, ValueError):
        return 212992  # Linux's default


@dataclass(slots=True)
class _Rate:
    window_start: float
    count: int = 0
    last_rate: float = 0.0


@dataclass(slots=True)
class _Episode:
    started: float
    last_loss: float
    lost: int


class LossWatch:
    def __init__(self, events: EventLog) -> None:
        self._events = events
        self._rates: dict[int, _Rate] = {}
        self._episodes: dict[int, _Episode] = {}
        self.lost_total = 0
        """Messages lost on this node since the daemon started (every rank, every attempt)."""
        self.episodes = 0
        self.peak_rate = 0.0
        """The highest messages/s one rank sent in a RATE_WINDOW_S window, any attempt."""

    def received(self, rank: RankHealth, now: float) -> None:
        """One message of `rank` arrived: its rate over the current window."""
        rate = self._rates.get(rank.global_rank)
        if rate is None:
            rate = self._rates[rank.global_rank] = _Rate(now)
        elif now - rate.window_start >= RATE_WINDOW_S:
            rate.last_rate = rate.count / (now - rate.window_start)
            self.peak_rate = max(self.peak_rate, rate.last_rate)
            rate.window_start, rate.count = now, 0
        rate.count += 1

    def rate(self, rank: RankHealth, now: float) -> float:
        """Messages/s of `rank`: the current window's, or the last complete one's if higher."""
        rate = self._rates.get(rank.global_rank)
        if rate is None:
            return 0.0
        current = rate.count / max(now - rate.window_start, 1e-3)
        return max(current, rate.last_rate)

    def lost(self, rank: RankHealth, count: int, now: float) -> None:
        self.lost_total += count
        episode = self._episodes.get(rank.global_rank)
        if episode is not None and now - episode.last_loss < EPISODE_QUIET_S:
            episode.lost += count
            episode.last_loss = now
            return
        self.episodes += 1
        self._episodes[rank.global_rank] = _Episode(now, now, count)
        rate = self.rate(rank, now)
        log.warning(
            "rank %d (local %d): %d messages lost before this one, at %.0f messages/s (the "
            "daemon did not keep up, or was paused); its sections are re-synced from its "
            "state, never judged on a lost message; further losses are counted",
            rank.global_rank,
            rank.local_rank,
            count,
            rate,
        )
        self._events.emit(
            EventKind.MESSAGES_LOST,
            global_rank=rank.global_rank,
            local_rank=rank.local_rank,
            lost=count,
            dropped_messages=rank.dropped_messages,
            rate_per_s=round(rate, 1),
        )

    def forget(self) -> None:
        """A new attempt: its ranks' rates and episodes start afresh."""
        self._rates.clear()
        self._episodes.clear()


class BudgetWatch:
    def __init__(self, events: EventLog) -> None:
        self._events = events
        self.refused: collections.Counter[str] = collections.Counter()
        self._said: set[tuple[int, str]] = set()

    def exceeded(self, rank: RankHealth, error: BudgetExceeded) -> None:
        self.refused[error.budget] += 1
        if (rank.global_rank, error.budget) in self._said:
            return
        self._said.add((rank.global_rank, error.budget))
        log.warning(
            "rank %d: %s (budget %s); refused, further refusals are counted",
            rank.global_rank,
            str(error),
            error.budget,
        )
        self._events.emit(
            EventKind.BUDGET_EXCEEDED,
            global_rank=rank.global_rank,
            local_rank=rank.local_rank,
            budget=error.budget,
            detail=str(error)[:200],
        )

    def forget(self) -> None:
        self._said.clear()
