"""The event log: a ring buffer for readers plus a JSONL file so nothing is lost on restart.

Status, the API (`/v1/events`, its SSE stream) and the benchmarks read it; only the daemon's
loop writes it. Ids are monotonic across daemon restarts (continued from the file) and
contiguous within a process, so the ring finds an id by arithmetic: reading the k events after
an id costs O(k), whatever the ring's size, and each event costs O(1) per subscriber.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import json
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftd import containment
from ftd.status.event_kind import EventKind
from ftd.status.rank_budget import (
    RANK_EVENTS_BUDGET,
    RANK_EVENTS_BURST,
    RANK_EVENTS_PER_S,
    RankBudget,
)

log = logging.getLogger("ftd.events")

DEFAULT_CAPACITY = 10_000
MAX_JOURNAL_BYTES = 64 * 1024 * 1024
"""events.jsonl's size before it is rotated to events.jsonl.1 (the one older file kept)."""


@dataclass(frozen=True)
class Event:
    id: int
    time: float
    """Wall-clock seconds (time.time()), comparable across processes."""
    kind: str
    data: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "time": self.time, "kind": self.kind, "data": self.data}


class Lagged(Exception):
    """A subscriber fell behind by more events than its queue holds; it missed some."""


class Subscription:
    """One reader's bounded view of the log: first the events after `after` that the ring
    still holds (read from the ring, page by page), then every event emitted since it
    subscribed, queued for it. A queue that fills marks it `lagged` (the queue is emptied:
    it would only grow) and `next_batch` raises Lagged from then on."""

    def __init__(self, log: EventLog, after: int, max_pending: int) -> None:
        self._log = log
        self.cursor = after
        """The id of the last event handed out."""
        self._live_from = log.last_id
        self._pending: collections.deque[Event] = collections.deque()
        self._max_pending = max_pending
        self._ready = asyncio.Event()
        self.lagged = False
        self.ended = False

    def offer(self, event: Event) -> None:
        """The log's emit: O(1)."""
        if self.lagged or self.ended:
            return
        if len(self._pending) >= self._max_pending:
            self.lagged = True
            self._pending.clear()
        else:
            self._pending.append(event)
        self._ready.set()

    def end(self) -> None:
        """No more events: `next_batch` returns [] from now on (the log or the API closes)."""
        self.ended = True
        self._ready.set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def next_batch(self, limit: int = 500) -> list[Event]:
        """The next events (at most `limit`), waiting for one; [] once ended. Lagged when the
        reader fell behind."""
        if self.cursor < self._live_from and not self.ended:
            page = self._log.since(self.cursor, min(limit, self._live_from - self.cursor))
            if page:
                self.cursor = page[-1].id
                return page
            self.cursor = self._live_from
        while True:
            if self.lagged:
                raise Lagged(f"fell behind by more than {self._max_pending} events")
            if self.ended:
                return []
            batch: list[Event] = []
            while self._pending and len(batch) < limit:
                event = self._pending.popleft()
                if event.id > self.cursor:
                    batch.append(event)
            if batch:
                self.cursor = batch[-1].id
                return batch
            self._ready.clear()
            await self._ready.wait()

    def close(self) -> None:
        self.end()
        self._log._unsubscribe(self)


class EventLog:
    def __init__(
        self,
        path: Path | None,
        capacity: int = DEFAULT_CAPACITY,
        on_failure: Callable[[str, str], object] | None = None,
        on_recovery: Callable[[int], object] | None = None,
        max_journal_bytes: int = MAX_JOURNAL_BYTES,
        rank_budget: RankBudget | None = None,
    ) -> None:
        """`on_failure`, `on_recovery`: told when writes to the file start failing (cause,
        detail) and work again (lines lost)."""
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self._capacity = capacity
        self._slots: list[Event | None] = [None] * capacity
        """Event `id` lives at `id % capacity` while it is among the newest `capacity`."""
        self._next_id = 1
        self._journal: Journal | None = None
        self._subscribers: set[Subscription] = set()
        self.rank_budget = rank_budget or RankBudget()
        """What each rank's messages may add (`emit_for_rank`)."""
        if path is not None:
            # First: it refuses a link or a non-file there.
            self._journal = Journal(path, on_failure, on_recovery, max_journal_bytes)
            self._next_id = _last_id(path) + 1
        self._first_id = self._next_id
        """The first id this process emitted (older ones are only in the file)."""

    def emit(self, kind: str, /, **data: Any) -> Event:
        event = Event(self._next_id, time.time(), kind, data)
        self._next_id += 1
        self._slots[event.id % self._capacity] = event
        if self._journal is not None:
            # If the journal fails, the event is still in the ring and the streams.
            containment.call("events", self._journal_line, event)
        for subscription in self._subscribers:
            subscription.offer(event)
        return event

    def emit_for_rank(self, rank: int, kind: str, /, **data: Any) -> Event | None:
        """An event a rank's message causes, within the rank's budget (RankBudget): past it
        the event is dropped and counted, and the first of a flood is one `budget_exceeded`."""
        allowed = self.rank_budget.take(rank)
        if allowed:
            return self.emit(kind, **data)
        if allowed is None:
            log.warning(
                "rank %d: more than %d events at %g a second; its further events are counted, "
                "not recorded, until it slows down",
                rank,
                RANK_EVENTS_BURST,
                RANK_EVENTS_PER_S,
            )
            self.emit(
                EventKind.BUDGET_EXCEEDED,
                global_rank=rank,
                budget=RANK_EVENTS_BUDGET,
                detail=f"more than {RANK_EVENTS_BURST} events at {RANK_EVENTS_PER_S:g}/s",
            )
        return None

    def _journal_line(self, event: Event) -> None:
        if self._journal is not None:
            self._journal.append(json.dumps(event.to_dict(), default=str) + "\n")

    def since(self, event_id: int = 0, limit: int | None = None) -> list[Event]:
        """Events with an id above `event_id`, oldest first (those still in the ring)."""
        start = max(event_id + 1, self._first_id, self._next_id - self._capacity)
        end = self._next_id if limit is None else min(self._next_id, start + max(0, limit))
        slots, capacity = self._slots, self._capacity
        return [event for i in range(start, end) if (event := slots[i % capacity]) is not None]

    @property
    def last_id(self) -> int:
        return self._next_id - 1

    def subscribe(self, after: int, max_pending: int) -> Subscription:
        """A reader of the events after `after`, with room for `max_pending` unread new ones;
        `close()` it when done."""
        subscription = Subscription(self, after, max_pending)
        self._subscribers.add(subscription)
        return subscription

    def _unsubscribe(self, subscription: Subscription) -> None:
        self._subscribers.discard(subscription)

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def close(self) -> None:
        for subscription in list(self._subscribers):
            subscription.end()
        if self._journal is not None:
            self._journal.close()
            self._journal = None

    @property
    def journal(self) -> Journal | None:
        return self._journal


class Journal:
    """events.jsonl: appended a whole line at a time (a write cut short is undone, so no line
    is ever torn), never following a planted link, never raising: a full disk or a file-size
    limit loses the line from the file only (the ring keeps it), said once until writes work
    again."""

    def __init__(
        self,
        path: Path,
        on_failure: Callable[[str, str], object] | None = None,
        on_recovery: Callable[[int], object] | None = None,
        max_bytes: int = MAX_JOURNAL_BYTES,
    ) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._fd = _open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        self._size = os.fstat(self._fd).st_size
        self.lost = 0
        """Lines that could not be written (they are in memory only)."""
        self._torn = False
        self.failing: str | None = None
        self.on_failure = on_failure
        """(cause, detail) when writes start failing (not for each line)."""
        self.on_recovery = on_recovery
        """(lines lost) when writes work again after failing."""

    def append(self, line: str) -> None:
        if self._fd < 0:
            return
        data = line.encode()
        try:
            self._write_whole(data)
        except OSError as error:
            self.lost += 1
            cause = errno.errorcode.get(error.errno or 0, "error").lower()
            if self.failing != cause:
                self.failing = cause
                log.error(
                    "could not append to %s (%s: %s): events are kept in memory (GET /v1/events)"
                    " until it can be written again",
                    self.path,
                    cause,
                    error.strerror or error,
                )
                if self.on_failure is not None:
                    callback, self.on_failure = self.on_failure, None  # no recursion
                    try:
                        callback(cause, str(error.strerror or error))
                    finally:
                        self.on_failure = callback
            return
        self._size += len(data)
        if self._size >= self.max_bytes:
            self._rotate()
        if self.failing is not None:
            log.warning(
                "%s is written again (%d events were kept in memory only)", self.path, self.lost
            )
            self.failing = None
            if self.on_recovery is not None:
                recovered, self.on_recovery = self.on_recovery, None  # no recursion
                try:
                    recovered(self.lost)
                finally:
                    self.on_recovery = recovered

    def _rotate(self) -> None:
        """events.jsonl -> events.jsonl.1 (replacing the older one), and a new events.jsonl;
        where that fails, the file grows on and the rotation is tried at the next line."""
        fresh = self.path.with_name(self.path.name + ".new")
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(fresh)
            fd = _open_regular(fresh, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL)
        except OSError as error:
            self.max_bytes *= 2  # tried again when the file has doubled, not at every line
            log.warning("could not rotate %s: %s", self.path, error.strerror or error)
            return
        try:
            os.replace(self.path, rotated(self.path))
        except OSError as error:
            self.max_bytes *= 2
            log.warning("could not rotate %s: %s", self.path, error.strerror or error)
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(fresh)
            return
        os.replace(fresh, self.path)  # the same directory: cannot fail once the first did not
        os.close(self._fd)
        self._fd, self._size, self._torn = fd, 0, False

    def _write_whole(self, data: bytes) -> None:
        """Append `data` whole, or raise OSError with the file as it was: a write cut short
        (a file-size limit, a full disk) is followed by one for the rest, which says why it
        cannot go on (EFBIG, ENOSPC), and the part written is cut off again."""
        if self._torn:  # a part of an earlier line could not be cut off then
            os.ftruncate(self._fd, self._size)
            self._torn = False
        done = 0
        try:
            while done < len(data):
                done += os.write(self._fd, data[done:])
        except OSError:
            if done:
                try:
                    os.ftruncate(self._fd, self._size)
                except OSError:
                    self._torn = True
            raise

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _open_regular(path: Path, flags: int) -> int:
    """A descriptor of the regular file at `path` (created 0600 with O_CREAT), never through
    a link and never blocking on a FIFO planted there; OSError otherwise."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file")
    return fd


def rotated(path: Path) -> Path:
    """Where events.jsonl's older events go when it is rotated."""
    return path.with_name(path.name + ".1")


def _last_id(path: Path) -> int:
    """The id of the file's last complete event (0 for none), or of the rotated one's when the
    file holds none yet; a torn last line is skipped."""
    last = _last_id_in(path)
    if last == 0:
        with contextlib.suppress(OSError):
            last = _last_id_in(rotated(path))
    return last


def _last_id_in(path: Path) -> int:
    last = 0
    with open(_open_regular(path, os.O_RDONLY), encoding="utf-8") as lines:
        for line in lines:
            try:
                last = max(last, int(json.loads(line)["id"]))
            except (ValueError, KeyError, TypeError):
                log.warning("skipping a malformed line in %s", path)
    return last
