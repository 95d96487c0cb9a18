"""The writer threads of rank output (ftd/ranks/output.py): whole lines to files or the console,
bounded per destination, and what could not be written counted.

A destination's failed write is cut back to its last whole line (a file), dropped and counted;
the destination is then left alone for `RETRY_S` (what comes meanwhile is dropped without
touching the disk). The first drop starts an episode, reported once; it ends at the first
write that succeeds `QUIET_S` after the last drop.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ftd.status.instruments import OUTPUT_DROPPED_BYTES, OUTPUT_DROPPED_LINES

log = logging.getLogger("ftd.rank_output")

PENDING_LIMIT = 2 << 20
"""Bytes of one rank stream waiting for one destination; beyond, new lines are dropped. Twice
the most the loop reads from one pipe at a time, so a burst does not drop while the writer
waits its turn for the GIL; at most 4 such buffers per rank (stdout and stderr, file and
console) under pressure."""
RETRY_S = 1.0
QUIET_S = 10.0
WRITE_PIECE = 1 << 16
"""The most one write call takes: a destination's progress (`written`) shows within a piece,
so a slow disk is told from a stuck one (ftd/ranks/output.py's holds)."""

DestinationKind = Literal["file", "console"]
Report = Callable[[str, "Destination", str], None]
"""(phase: "start" | "end", the destination, the reason) from any thread."""


@dataclass(eq=False)
class Destination:
    """Where one rank stream's lines go, and what was lost on the way. Changed under its
    writer's lock (`pending`, the drop counts) or by its writer thread only (`offset`)."""

    kind: DestinationKind
    fd: int
    local_rank: int
    stream: str
    where: str
    offset: int = 0
    written: int = 0
    """Bytes written so far, by its writer thread alone: its progress, read by the loop."""
    pending: int = 0
    retry_at: float = 0.0
    last_drop: float = 0.0
    in_episode: bool = False
    episode_bytes: int = 0
    episode_lines: int = 0
    dropped_bytes: int = 0
    dropped_lines: int = 0

    @property
    def label(self) -> str:
        return f"local rank {self.local_rank}'s {self.stream}"


def count_lines(data: bytes) -> int:
    return data.count(b"\n") + (0 if data.endswith(b"\n") else 1)


class LineWriter:
    """One thread writing whole lines to its destinations; bounded per destination."""

    def __init__(self, name: str, report: Callable[[str, Destination, str], None]) -> None:
        self._name = name
        self._report = report
        self._cond = threading.Condition()
        self._queue: list[tuple[Destination, bytes]] = []
        self._owned: list[int] = []
        self._closing = False
        self._thread: threading.Thread | None = None
        self._loop = asyncio.get_running_loop()
        self.finished: asyncio.Future[None] = self._loop.create_future()

    def own(self, fd: int) -> None:
        """Close `fd` when the writer finishes."""
        self._owned.append(fd)

    def put(self, dest: Destination, data: bytes) -> None:
        """On the loop: queue whole lines, or drop them if `dest` has too much waiting."""
        with self._cond:
            if dest.pending + len(data) > PENDING_LIMIT:
                self._drop(dest, data, "its writer is behind (the disk is slower than the rank)")
                return
            dest.pending += len(data)
            self._queue.append((dest, data))
            if len(self._queue) == 1:
                self._cond.notify()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"ftd-output-{self._name}", daemon=True
                )
                self._thread.start()

    def close(self) -> None:
        """Write what is queued, close the owned files, then set `finished`."""
        with self._cond:
            self._closing = True
            self._cond.notify()
            started = self._thread is not None
        if not started:
            self._close_owned()
            self.finished.set_result(None)

    def _run(self) -> None:
        try:
            while batch := self._next_batch():
                grouped: dict[Destination, list[bytes]] = {}
                for dest, data in batch:
                    grouped.setdefault(dest, []).append(data)
                for dest, chunks in grouped.items():
                    data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                    self._write(dest, data)
                    with self._cond:
                        dest.pending -= len(data)
        except BaseException:  # a bug here must not pass silently: say it, keep nothing open
            log.exception("the %s writer of rank output failed", self._name)
        finally:
            self._close_owned()
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                self._loop.call_soon_threadsafe(self._finish)

    def _finish(self) -> None:
        if not self.finished.done():
            self.finished.set_result(None)

    def _next_batch(self) -> list[tuple[Destination, bytes]]:
        with self._cond:
            while not self._queue and not self._closing:
                self._cond.wait()
            batch, self._queue = self._queue, []
            return batch

    def _close_owned(self) -> None:
        owned, self._owned = self._owned, []
        for fd in owned:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _write(self, dest: Destination, data: bytes) -> None:
        """In the thread: all of `data` or, on an error, none of it (a file is cut back)."""
        now = time.monotonic()
        if now < dest.retry_at:
            with self._cond:
                self._drop(dest, data, "")
            return
        start, written = dest.offset, 0
        view = memoryview(data)
        try:
            while written < len(data):
                piece = view[written : written + WRITE_PIECE]
                if dest.kind == "file":
                    count = os.pwrite(dest.fd, piece, start + written)
                else:
                    count = os.write(dest.fd, piece)
                if count == 0:
                    raise OSError(errno.EIO, "nothing written")
                written += count
                dest.written += count
        except OSError as error:
            if written and dest.kind == "file":
                with contextlib.suppress(OSError):
                    os.ftruncate(dest.fd, start)  # the file ends with a whole line again
                    written = 0
            dest.offset = start + written
            with self._cond:
                dest.retry_at = now + RETRY_S
                self._drop(dest, data[written:], os.strerror(error.errno or errno.EIO))
            return
        dest.offset = start + written
        if dest.in_episode:
            with self._cond:  # the loop may have dropped for it meanwhile
                if dest.in_episode and now - dest.last_drop >= QUIET_S:
                    self._end_episode(dest)

    def _drop(self, dest: Destination, data: bytes, reason: str) -> None:
        """With the lock held: count `data` as lost; a new episode is reported."""
        lines = count_lines(data)
        dest.episode_bytes += len(data)
        dest.episode_lines += lines
        dest.dropped_bytes += len(data)
        dest.dropped_lines += lines
        dest.last_drop = time.monotonic()
        OUTPUT_DROPPED_BYTES.labels(dest.kind).inc(len(data))
        OUTPUT_DROPPED_LINES.labels(dest.kind).inc(lines)
        if not dest.in_episode:
            dest.in_episode = True
            self._report("start", dest, reason or "an earlier write failed")

    def _end_episode(self, dest: Destination) -> None:
        dest.in_episode = False
        self._report("end", dest, "")
        dest.episode_bytes = dest.episode_lines = 0
