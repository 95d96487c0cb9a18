"""The event log: a ring buffer for readers plus a JSONL file so nothing is lost on restart.

Status, the API (`/v1/events`, its SSE stream) and the benchmarks read it; only the daemon's
loop writes it. Ids are monotonic across daemon restarts (continued from the file).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

log = logging.getLogger("ftd.events")

DEFAULT_CAPACITY = 10_000


@dataclass(frozen=True)
class Event:
    id: int
    time: float
    """Wall-clock seconds (time.time()), comparable across processes."""
    kind: str
    data: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "time": self.time, "kind": self.kind, "data": self.data}


class EventLog:
    def __init__(self, path: Path | None, capacity: int = DEFAULT_CAPACITY) -> None:
        self._ring: collections.deque[Event] = collections.deque(maxlen=capacity)
        self._next_id = 1
        self._file: IO[str] | None = None
        self._changed: asyncio.Event | None = None
        if path is not None:
            self._next_id = _last_id(path) + 1
            self._file = path.open("a", encoding="utf-8", buffering=1)

    def emit(self, kind: str, /, **data: Any) -> Event:
        event = Event(self._next_id, time.time(), kind, data)
        self._next_id += 1
        self._ring.append(event)
        if self._file is not None:
            self._file.write(json.dumps(event.to_dict(), default=str) + "\n")
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        return event

    def since(self, event_id: int = 0, limit: int | None = None) -> list[Event]:
        """Events with an id above `event_id`, oldest first (those still in the ring)."""
        events = [event for event in self._ring if event.id > event_id]
        return events[:limit] if limit is not None else events

    @property
    def last_id(self) -> int:
        return self._next_id - 1

    async def wait_after(self, event_id: int) -> list[Event]:
        """Await events newer than `event_id` (for streams); no polling."""
        while True:
            events = self.since(event_id)
            if events:
                return events
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _last_id(path: Path) -> int:
    """The id of the file's last complete event (0 for none); a torn last line is skipped."""
    if not path.exists():
        return 0
    last = 0
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            try:
                last = max(last, int(json.loads(line)["id"]))
            except (ValueError, KeyError, TypeError):
                log.warning("skipping a malformed line in %s", path)
    return last
