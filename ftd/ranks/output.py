"""Rank output with -r/-t: the ranks' pipes read on the event loop, whole lines written to the
log files (and, with --tee, to the daemon's console) by writer threads.

A rank's stdout and stderr are pipes (ftd/ranks/spawn/output.py). The loop reads them as they fill,
in big reads (after a read it waits up to `BATCH_S` before the next one, less if the rank
would fill half its pipe sooner: a chatty rank costs tens of wake-ups a second, not one per
line), cuts the data at its last newline and hands whole lines to a `LineWriter`. A writer
thread does the disk's work (ftd/ranks/output_writer.py), so a slow or stuck disk never holds the
loop. A writer that falls behind (`HOLD_AT` bytes waiting: a burst while its thread waits for a
core, a disk slower than the rank) holds the reading of that stream, so the rank's writes wait
on its full pipe as they would on the disk under torchrun: a slow writer loses nothing. A hold
lasts while the writers make progress; a writer that wrote nothing for `STALL_S`, over at least
`STALL_CHECKS` looks (a daemon that was itself not run for a second gave its writer no chance),
is taken for stuck, and the loop reads on without holding until it caught up. What a writer
cannot take then (more than `PENDING_LIMIT` bytes waiting for one destination) or cannot write
(ENOSPC, EIO, EFBIG) is dropped and counted: a rank's write never fails; it waits on a slow
writer as it would on the disk, on a stuck one once (about `STALL_S`), or while the daemon
itself does not run (stopped, starved) for longer than the rank's pipe takes to fill
(`PIPE_SIZE`: 1 MiB, about 0.1 s at 10 MB/s; 64 KiB where the pipe cannot be raised).

A destination that drops starts an episode: one warning and one `output_dropped` event; it
ends, with one line giving what was lost, at the first write that succeeds `QUIET_S` after the
last drop, or when the attempt's output is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ftd.ranks.output_writer import PENDING_LIMIT, Destination, LineWriter
from ftd.ranks.spawn.base import RankStream
from ftd.tasks import within

log = logging.getLogger("ftd.rank_output")

READ_SIZE = 1 << 20
MAX_LINE = 1 << 16
"""A line longer than this is written in pieces (a piece without its newline)."""
BATCH_S = 0.05
"""After a read, the next one waits this long at most (see `_readable`)."""
BATCH_MIN_S = 0.002
CLOSE_TIMEOUT_S = 5.0
CLOSE_HOLD_S = 30.0
"""The longest the close waits on writers behind but moving: a slow disk or console does not
hold the next attempt longer (what they cannot take then is dropped and counted)."""
HOLD_AT = PENDING_LIMIT - READ_SIZE - MAX_LINE
"""Bytes waiting for a destination from which its stream's reading is held: the next read
(READ_SIZE, and a carried line piece) still fits under PENDING_LIMIT."""
STALL_S = 1.0
"""A writer behind that wrote nothing for this long is stuck (see the module's text)."""
STALL_CHECKS = round(STALL_S / BATCH_S)
"""...and over at least this many looks at it, BATCH_S apart."""

DropReport = Callable[[dict[str, object]], object]


class LineSplitter:
    """A byte stream cut into whole lines: what `feed` returns ends with a newline, unless a
    line grew to MAX_LINE bytes (then that much of it goes on its own). Holds less than
    MAX_LINE bytes between calls; linear in what it is fed."""

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self._max_line = max_line
        self._carry = bytearray()

    def feed(self, data: bytes) -> bytes:
        carry = self._carry
        end = data.rfind(b"\n") + 1
        if end == 0:  # no line ends here: the carry grows (copied only when a line ends)
            carry += data
            if len(carry) < self._max_line:
                return b""
            whole = bytes(carry)
            carry.clear()
            return whole
        lines = bytes(carry) + data[:end] if carry else data[:end]
        carry.clear()
        rest = data[end:]
        if len(rest) >= self._max_line:
            return lines + rest
        carry += rest
        return lines

    def flush(self) -> bytes:
        """What is left (the stream ended): a last line without its newline."""
        rest = bytes(self._carry)
        self._carry.clear()
        return rest


@dataclass(eq=False)
class _Reader:
    stream: RankStream
    file: Destination
    console: Destination | None
    lines: LineSplitter = field(default_factory=lambda: LineSplitter())
    paused: bool = False
    closed: bool = False
    read_at: float = 0.0
    held: bool = False
    may_hold: bool = True
    """False once a hold ran out (its writer stuck): read on until the writers caught up."""
    progress: int = 0
    quiet_since: float = 0.0
    quiet_looks: int = 0

    def watch(self, now: float) -> None:
        """Start judging its writers' progress (a hold, the close)."""
        self.progress, self.quiet_since, self.quiet_looks = self._written(), now, 0

    def stuck(self, now: float) -> bool:
        """One look: a writer wrote nothing for STALL_S, over STALL_CHECKS looks."""
        written = self._written()
        if written != self.progress:
            self.progress, self.quiet_since, self.quiet_looks = written, now, 0
            return False
        self.quiet_looks += 1
        return self.quiet_looks >= STALL_CHECKS and now - self.quiet_since >= STALL_S

    def _written(self) -> int:
        return sum(d.written for d in (self.file, self.console) if d is not None)

    def behind(self) -> bool:
        """A destination of this stream has HOLD_AT bytes waiting (read without the writer's
        lock: an int, at worst a moment old)."""
        return any(d is not None and d.pending >= HOLD_AT for d in (self.file, self.console))


class OutputDrain:
    """An attempt's redirected rank output, from the ranks' pipes to the files (and console)."""

    def __init__(self, attempt: int, on_dropped: DropReport | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._attempt = attempt
        self._on_dropped = on_dropped
        self._files = LineWriter("files", self._report)
        self._console = LineWriter("console", self._report)
        self._readers: list[_Reader] = []
        self._buffer = bytearray(READ_SIZE)
        self._closed = False
        self.console_fds = {"stdout": 1, "stderr": 2}
        """Where tee'd lines go: the daemon's own stdout and stderr."""

    def attach(self, streams: Sequence[RankStream]) -> None:
        """Read these streams from now on; the drain owns their descriptors."""
        for stream in streams:
            file = Destination("file", stream.file_fd, stream.local_rank, stream.name, stream.path)
            self._files.own(stream.file_fd)
            console = None
            if stream.tee:
                fd = self.console_fds[stream.name]
                where = f"the daemon's {stream.name}"
                console = Destination("console", fd, stream.local_rank, stream.name, where)
            reader = _Reader(stream, file, console, read_at=self._loop.time())
            self._readers.append(reader)
            self._loop.add_reader(stream.read_fd, self._readable, reader)

    def _readable(self, reader: _Reader) -> None:
        now = self._loop.time()
        got = self._read(reader)
        elapsed, reader.read_at = now - reader.read_at, now
        if not got or reader.closed:
            return
        if reader.behind():
            if reader.may_hold:
                self._hold(reader, now)
                return
        else:
            reader.may_hold = True
        # Wait before the next read, but never longer than the rank, at the rate it just
        # wrote, takes to fill half its pipe: batches, and a rank that never waits on us.
        pause = min(BATCH_S, reader.stream.pipe_size / 2 * elapsed / got)
        if pause >= BATCH_MIN_S:
            self._loop.remove_reader(reader.stream.read_fd)
            reader.paused = True
            self._loop.call_later(pause, self._resume, reader)

    def _hold(self, reader: _Reader, now: float) -> None:
        """Stop reading `reader` until its writers caught up, or one is stuck (checked every
        BATCH_S: only while a writer is behind)."""
        if not reader.paused:
            self._loop.remove_reader(reader.stream.read_fd)
            reader.paused = True
        reader.held = True
        reader.watch(now)
        self._loop.call_later(BATCH_S, self._check_hold, reader)

    def _check_hold(self, reader: _Reader) -> None:
        if reader.closed or not reader.held:
            return
        if reader.behind():
            if not reader.stuck(self._loop.time()):
                self._loop.call_later(BATCH_S, self._check_hold, reader)
                return
            reader.may_hold = False  # stuck: what it cannot take is dropped and counted
        reader.held = False
        self._resume(reader)

    def _resume(self, reader: _Reader) -> None:
        if reader.paused and not reader.closed and not reader.held:
            reader.paused = False
            self._loop.add_reader(reader.stream.read_fd, self._readable, reader)

    def _read(self, reader: _Reader) -> int:
        """Everything the pipe holds now (up to READ_SIZE more per call); bytes read."""
        total = 0
        buffer = self._buffer
        while total < READ_SIZE:
            try:
                count = os.readv(reader.stream.read_fd, [buffer])
            except BlockingIOError:
                break
            except OSError as error:
                log.warning("reading %s failed: %s", reader.file.label, error)
                count = 0
            if count == 0:
                self._end_of_stream(reader)
                break
            total += count
            self._feed(reader, bytes(memoryview(buffer)[:count]))
        return total

    def _feed(self, reader: _Reader, data: bytes) -> None:
        lines = reader.lines.feed(data)
        if lines:
            self._emit(reader, lines)

    def _emit(self, reader: _Reader, data: bytes) -> None:
        self._files.put(reader.file, data)
        if reader.console is not None:
            self._console.put(reader.console, prefixed(reader.stream.prefix, data))

    def _end_of_stream(self, reader: _Reader) -> None:
        if reader.closed:
            return
        reader.closed = True
        if not reader.paused:
            self._loop.remove_reader(reader.stream.read_fd)
        with contextlib.suppress(OSError):
            os.close(reader.stream.read_fd)
        rest = reader.lines.flush()
        if rest:
            self._emit(reader, rest)

    async def close(self) -> None:
        """Once the ranks are gone: read what their pipes still hold, write it (bounded:
        CLOSE_HOLD_S, then CLOSE_TIMEOUT_S), close everything. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # What the pipes still hold is the ranks' last words: a writer behind is waited for
        # as a hold would (until it is stuck), not dropped.
        until = self._loop.time() + CLOSE_HOLD_S
        for reader in self._readers:
            reader.held = False  # its hold's looks end: these take over
            reader.watch(self._loop.time())
        while waiting := [r for r in self._readers if not r.closed and r.may_hold and r.behind()]:
            now = self._loop.time()
            if any([r.stuck(now) for r in waiting]) or now >= until:  # every one looked at
                break
            await asyncio.sleep(BATCH_S)
        for reader in self._readers:
            if not reader.closed:
                self._read(reader)
                self._end_of_stream(reader)
        self._files.close()
        self._console.close()
        writers = asyncio.gather(self._files.finished, self._console.finished)
        try:
            await within(asyncio.shield(writers), CLOSE_TIMEOUT_S)
        except TimeoutError:
            log.warning(
                "rank output of attempt %d: its writers did not finish within %.0fs (a stuck "
                "disk or console?); what they hold is lost",
                self._attempt,
                CLOSE_TIMEOUT_S,
            )
        for reader in self._readers:
            for dest in (reader.file, reader.console):
                if dest is not None and dest.in_episode:
                    self._report("end", dest, "")

    def dropped(self, kind: str = "file") -> tuple[int, int]:
        """(bytes, lines) of this attempt's output dropped on the way to `kind` destinations."""
        dests = [d for r in self._readers for d in (r.file, r.console) if d and d.kind == kind]
        return sum(d.dropped_bytes for d in dests), sum(d.dropped_lines for d in dests)

    def _report(self, phase: str, dest: Destination, reason: str) -> None:
        """From any thread: an episode's start (a warning, an event) or end (one line)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed
            self._loop.call_soon_threadsafe(
                self._said, phase, dest, reason, dest.episode_bytes, dest.episode_lines
            )

    def _said(self, phase: str, dest: Destination, reason: str, size: int, lines: int) -> None:
        if phase == "end":
            log.warning(
                "attempt %d: %s: %d bytes (%d lines) of output were dropped, not written to %s",
                self._attempt,
                dest.label,
                size,
                lines,
                dest.where,
            )
            return
        log.warning(
            "attempt %d: %s cannot be written to %s (%s); dropping it, counted, until it can",
            self._attempt,
            dest.label,
            dest.where,
            reason,
        )
        if self._on_dropped is None:
            return
        try:
            self._on_dropped(
                {
                    "local_rank": dest.local_rank,
                    "stream": dest.stream,
                    "destination": dest.kind,
                    "path": dest.where,
                    "reason": reason,
                }
            )
        except Exception:  # the event is a convenience: the warning above said it
            log.exception("attempt %d: recording output_dropped failed", self._attempt)


def prefixed(prefix: bytes, data: bytes) -> bytes:
    """Each line of `data` after `prefix`, as torchrun's --tee prints them."""
    if not prefix:
        return data
    body = data[:-1] if data.endswith(b"\n") else data
    return prefix + body.replace(b"\n", b"\n" + prefix) + b"\n"
