"""Rank output with -r/-t goes through the daemon (ftd/ranks/output.py): a full log disk drops
output, counted and said once, and never fails a rank's write; --tee keeps torchrun's prefixes
and whole lines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftd.ranks.output import LineSplitter, OutputDrain, prefixed
from ftd.ranks.output_writer import PENDING_LIMIT
from ftd.ranks.spawn.base import RankStream
from ftd.ranks.spawn.output import grow_pipe
from tests.conftest import BIN, ServeFactory, await_api_event, events_in
from tests.support.checks import AS_ROOT, api_session, assert_no_orphans, assert_sound, metric
from tests.support.fuzzing import fuzz_target

CHATTY = BIN / "chatty_rank.py"
METHODS = pytest.mark.parametrize("method", ["zygote", "spawn"])
LINE = re.compile(rb"r(\d) a(\d) (\d+) ([a-z]+)")


@contextlib.asynccontextmanager
async def small_disk(path: Path, size: str = "2m") -> AsyncIterator[Path]:
    """A tmpfs of `size` mounted at `path` for the test (skipped where mounting is refused)."""
    if not AS_ROOT:
        pytest.skip("mounting a small tmpfs needs root")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    mount = await asyncio.create_subprocess_exec(
        "mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path),
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, why = await mount.communicate()
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {why.decode().strip()}")
    try:
        yield path
    finally:
        umount = await asyncio.create_subprocess_exec("umount", "-l", str(path))
        await umount.wait()


async def await_files(paths: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths):
        assert time.monotonic() < deadline, f"never written: {[p for p in paths if not p.exists()]}"
        await asyncio.sleep(0.05)


def assert_whole_lines(path: Path, rank: int, attempt: int) -> int:
    """Every line of the log file is one the rank printed, whole; how many there are."""
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), f"{path} ends with a partial line: {data[-80:]!r}"
    lines = data.splitlines()
    for line in lines:
        match = LINE.fullmatch(line)
        assert match, f"{path}: not a whole line: {line[:80]!r}"
        assert (int(match[1]), int(match[2])) == (rank, attempt)
    return len(lines)


# -- (a) + (c): a full log disk ----------------------------------------------------------------


@METHODS
@pytest.mark.timeout(240)
async def test_a_full_log_disk_drops_output_and_the_job_completes(
    serve: ServeFactory, tmp_path: Path, method: str
) -> None:
    """--log-dir on a 2 MiB tmpfs, -r 3, two ranks printing 3 MiB each per attempt: attempt 0
    fills the disk and crashes (local rank 0 exits 1), attempt 1 prints to the full disk and
    completes. The job ends with exit 0; the dropped output is an `output_dropped` event
    (said once per stream and episode) and a counter; the files hold whole lines only; a rank
    printing to the full disk is neither killed nor held up (c)."""
    go, reports = tmp_path / "go", tmp_path / "reports"
    async with small_disk(tmp_path / "logs"):
        run = await serve(
            "--nproc-per-node", "2", "-r", "3", "--max-restarts", "1", "--start-method", method,
            script=CHATTY,
            script_args=("--mib", "3", "--stderr", "--crash-first", "--report", str(reports),
                         "--go", str(go)),
        )  # fmt: skip
        async with api_session(run) as (session, url, token):
            event = await await_api_event(url, "output_dropped", token=token, timeout=90)
            assert event["data"]["destination"] == "file", event  # type: ignore[index]
            # On a busy machine the writer may fall behind before the disk is full: that
            # episode's one event names the backlog; the full disk is named by attempt 1's.
            reasons = ("No space left on device", "its writer is behind")
            assert any(reason in str(event["data"]) for reason in reasons), event
            await await_files([reports / f"r{rank}_a1.json" for rank in (0, 1)], timeout=90)
            # Attempt 1 alone printed 2 x 3 MiB (and a tenth of it to stderr) to a full disk.
            # The ranks' reports come when they have printed; the daemon may still be draining
            # their pipes: the counters are read until they hold it all (or the deadline).
            deadline = asyncio.get_running_loop().time() + 60
            while True:
                async with session.get(f"{url}/metrics") as response:
                    text = await response.text()
                dropped = metric(text, "ftd_output_dropped_bytes_total", destination="file")
                lines = metric(text, "ftd_output_dropped_lines_total", destination="file")
                if dropped >= 6 * (1 << 20) and lines >= 6 * 1024:
                    break
                assert asyncio.get_running_loop().time() < deadline, text
                await asyncio.sleep(0.1)
            go.touch()
            assert await run.wait(timeout=90) == 0
        kept = {}
        for attempt in (0, 1):
            for rank in (0, 1):
                rank_dir = run.attempt_dir(attempt) / str(rank)
                kept[attempt, rank] = assert_whole_lines(rank_dir / "stdout.log", rank, attempt)
                assert_whole_lines(rank_dir / "stderr.log", rank, attempt)
        assert sum(kept.values()) < 2 * 1024, kept  # 2 MiB of disk: most was dropped
        dropped = [str(e["data"]) for e in events_in(run.run_dir, "output_dropped")]
        assert any("No space left on device" in data for data in dropped), dropped
        assert_sound(run)
        await assert_no_orphans(run.run_dir)
    for rank in (0, 1):
        report = json.loads((reports / f"r{rank}_a1.json").read_text())
        # 3 MiB in 3072 prints, the disk full all along: no print failed, none waited on it.
        assert report["seconds"] < 20, report
    said = re.findall(r"attempt (\d): local rank (\d)'s (\w+) cannot be written", run.stderr.text)
    assert said and len(said) == len(set(said)), said  # once per stream and episode


# -- (b): --tee ---------------------------------------------------------------------------------


@METHODS
async def test_b_tee_keeps_prefixes_and_whole_lines(serve: ServeFactory, method: str) -> None:
    """-t 3, two ranks printing 40 kB lines at once (every tenth to stderr too): on the daemon's
    stdout and stderr each line whole after its rank's torchrun prefix, in order; the files
    without prefixes."""
    line_bytes, count = 40_000, 52
    run = await serve(
        "--nproc-per-node", "2", "-t", "3", "--start-method", method,
        script=CHATTY,
        script_args=("--mib", str(count * line_bytes / (1 << 20)), "--line-bytes",
                     str(line_bytes), "--stderr"),
    )  # fmt: skip
    assert await run.wait() == 0
    for stream, expected in ((run.stdout, range(count)), (run.stderr, range(0, count, 10))):
        for rank in (0, 1):
            prefix = f"[default{rank}]:"
            mine = [line for line in stream.lines if line.startswith(prefix)]
            numbers = []
            for line in mine:
                match = LINE.fullmatch(line[len(prefix) :].encode())
                assert match and len(line) == len(prefix) + line_bytes - 1, line[:100]
                assert int(match[1]) == rank and set(match[4]) == {b"ab"[rank]}, line[:100]
                numbers.append(int(match[3]))
            assert numbers == list(expected)
        assert not [line for line in stream.lines if "[default" in line[1:]]
    for rank in (0, 1):
        rank_dir = run.attempt_dir(0) / str(rank)
        assert assert_whole_lines(rank_dir / "stdout.log", rank, 0) == count
        assert assert_whole_lines(rank_dir / "stderr.log", rank, 0) == len(range(0, count, 10))
    assert_sound(run)


async def test_attack_one_endless_line_of_binary_is_kept_byte_for_byte(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """A rank writes 3 MiB of bytes with no newline (NULs, escapes, invalid UTF-8), -r 1: the
    daemon holds no more than a piece of it at a time (rank_output.MAX_LINE), and the file has
    every byte as written; the daemon stays sound."""
    blob = bytes(range(256)).replace(b"\n", b"\r") * (3 * 4096)
    script = tmp_path / "binary_rank.py"
    script.write_text(
        "import os\n"
        f"blob = bytes(range(256)).replace(b'\\n', b'\\r') * {3 * 4096}\n"
        "view = memoryview(blob)\n"
        "while view:\n"
        "    view = view[os.write(1, view[:100_000]) :]\n"
    )
    run = await serve("--nproc-per-node", "1", "-r", "1", script=script)
    assert await run.wait() == 0
    assert (run.attempt_dir(0) / "0" / "stdout.log").read_bytes() == blob
    assert_sound(run)


async def test_stderr_tail_still_names_the_error(serve: ServeFactory, tmp_path: Path) -> None:
    """A spawned rank that dies at import with -r 2: its stderr reaches stderr.log through the
    daemon before the failure summary reads the tail."""
    script = tmp_path / "broken.py"
    script.write_text("print('x' * 100)\nraise SystemExit('the very last words')\n")
    run = await serve("--nproc-per-node", "1", "-r", "2", "--start-method", "spawn", script=script)
    assert await run.wait() == 1
    summary = run.stderr.text[run.stderr.text.index("restarts exhausted") :]
    assert "the very last words" in summary, summary


# -- the drain, in process ---------------------------------------------------------------------


def _stream(tmp_path: Path, file_fd: int, tee: bool = False) -> tuple[RankStream, int]:
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    os.set_blocking(read_fd, False)
    size = grow_pipe(write_fd)
    path = str(tmp_path / "stdout.log")
    return RankStream(0, "stdout", path, read_fd, file_fd, size, tee, b"[x0]:"), write_fd


async def test_a_writer_that_fails_every_write_never_holds_the_rank(tmp_path: Path) -> None:
    """Output to /dev/full (ENOSPC on every write): 64 MiB written into the pipe as fast as a
    thread can, never waiting long; all of it counted as dropped, one event."""
    events: list[dict[str, object]] = []
    drain = OutputDrain(7, events.append)
    stream, write_fd = _stream(tmp_path, os.open("/dev/full", os.O_WRONLY | os.O_CLOEXEC))
    drain.attach([stream])
    line = b"y" * 1023 + b"\n"
    chunk = line * 64
    waits: list[float] = []

    def rank() -> None:
        try:
            for _ in range(1024):
                started = time.monotonic()
                os.write(write_fd, chunk)
                waits.append(time.monotonic() - started)
        finally:
            os.close(write_fd)

    writer = threading.Thread(target=rank)
    writer.start()
    await asyncio.to_thread(writer.join, 60)
    await drain.close()
    assert not writer.is_alive()
    # One episode, whichever cause it met first: every write failing, or (on a busy machine,
    # the writer thread descheduled) the rank filling what waits for the writer.
    behind = "its writer is behind (the disk is slower than the rank)"
    assert len(events) == 1, events
    assert events[0]["reason"] in ("No space left on device", behind), events
    assert max(waits) < 2.0, max(waits)  # a busy machine may stall a thread; never the disk
    assert drain.dropped() == (64 << 20, 64 << 10)


async def test_the_console_is_bounded(tmp_path: Path) -> None:
    """-t, and a console nobody reads while a rank writes 4 MiB (a pipe of one page, left
    full): what waits for the console stays under PENDING_LIMIT, the rest is dropped and
    counted, the file gets everything; what reaches the console is whole lines after the
    prefix."""
    drain, write_fd, console_r, console_w = _teed(tmp_path)
    data = (b"z" * 99 + b"\n") * (40 << 10)  # 4 MiB
    await asyncio.to_thread(_write_all, write_fd, data, 256 << 10)
    deadline = time.monotonic() + 60
    while (tmp_path / "stdout.log").stat().st_size < len(data):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    received = bytearray()
    reader = threading.Thread(target=_read_all, args=(console_r, received))
    reader.start()
    await drain.close()
    os.close(console_w)
    await asyncio.to_thread(reader.join, 30)
    assert (tmp_path / "stdout.log").read_bytes() == data
    dropped_bytes, dropped_lines = drain.dropped("console")
    total = len(prefixed(b"[x0]:", data))
    assert len(received) + dropped_bytes == total
    assert 0 < len(received) <= PENDING_LIMIT + 4096, len(received)
    assert dropped_lines * 105 == dropped_bytes  # whole lines only
    lines = bytes(received).split(b"\n")
    assert lines.pop() == b""
    assert set(lines) == {b"[x0]:" + b"z" * 99}


async def test_a_slow_writer_holds_the_rank_and_loses_nothing(tmp_path: Path) -> None:
    """-t, and a console read slowly (a page every 2 ms: a pipe of one page) while a rank
    writes 8 MiB as fast as it can: the console falls behind by far more than PENDING_LIMIT,
    and the drain holds the rank's pipe instead of dropping (a hold ends as the console
    catches up): the console and the file get every byte, nothing is counted dropped."""
    await _teed_to_a_slow_console(tmp_path, (b"s" * 127 + b"\n") * (64 << 10), 0.002)


async def test_a_writer_slower_than_a_hold_but_moving_loses_nothing(tmp_path: Path) -> None:
    """-t, and a console that takes a page every 8 ms (~500 KiB/s) while a rank writes 2 MiB at
    once: each mebibyte the loop reads takes the console 2 s, longer than a hold's STALL_S,
    but the writer moves (a write call takes WRITE_PIECE, 0.13 s of it): the rank is held,
    nothing is dropped; the console and the file get every byte. (Before, one write of a whole
    read hid the writer's progress, and a writer that slow past STALL_S lost the rest.)"""
    await _teed_to_a_slow_console(tmp_path, (b"m" * 127 + b"\n") * (16 << 10), 0.008)


async def _teed_to_a_slow_console(tmp_path: Path, data: bytes, page_s: float) -> None:
    """A rank writes `data` in 1 MiB pieces to a -t stream whose console reads a page every
    `page_s`: nothing is dropped, the file and the console get every byte."""
    drain, write_fd, console_r, console_w = _teed(tmp_path)
    received = bytearray()

    def read_slowly() -> None:
        try:
            while chunk := os.read(console_r, 4096):
                received.extend(chunk)
                time.sleep(page_s)
        finally:
            os.close(console_r)

    console = threading.Thread(target=read_slowly)
    console.start()
    await asyncio.to_thread(_write_all, write_fd, data, 1 << 20)
    await drain.close()
    os.close(console_w)
    await asyncio.to_thread(console.join, 60)
    assert drain.dropped("console") == (0, 0) and drain.dropped() == (0, 0)
    assert (tmp_path / "stdout.log").read_bytes() == data
    assert bytes(received) == prefixed(b"[x0]:", data)


def _teed(tmp_path: Path) -> tuple[OutputDrain, int, int, int]:
    """A drain of one -t stream to `stdout.log` and a console pipe of one page: the drain,
    the rank's end of its pipe, the console's read and write ends."""
    console_r, console_w = os.pipe2(os.O_CLOEXEC)
    grow_pipe(console_w, 4096)
    file_fd = os.open(tmp_path / "stdout.log", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    drain = OutputDrain(0)
    drain.console_fds = {"stdout": console_w, "stderr": console_w}
    stream, write_fd = _stream(tmp_path, file_fd, tee=True)
    drain.attach([stream])
    return drain, write_fd, console_r, console_w


def _read_all(fd: int, into: bytearray) -> None:
    try:
        while chunk := os.read(fd, 1 << 16):
            into += chunk
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes, piece: int = 1 << 30) -> None:
    """As a rank writes: in pieces, a moment apart (the drain is another process's loop)."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view[:piece]) :]
            time.sleep(0.005)
    finally:
        os.close(fd)


# -- the decoder: fuzzed -----------------------------------------------------------------------


@fuzz_target("rank_output", 300)
@given(
    st.lists(st.binary(max_size=300) | st.sampled_from([b"\n", b"\n\n", b"a" * 70]), max_size=40),
    st.integers(min_value=1, max_value=64),
)
def test_fuzz_line_splitter(chunks: list[bytes], max_line: int) -> None:
    """Nothing lost, added or reordered; every piece is whole lines, but for a line cut at
    max_line; what is held between calls is under max_line and has no newline; linear."""
    splitter = LineSplitter(max_line)
    started = time.thread_time()
    out = []
    for chunk in chunks:
        piece = splitter.feed(chunk)
        out.append(piece)
        held = splitter.flush()
        assert len(held) < max_line and b"\n" not in held
        splitter.feed(held)  # put it back
        if piece and not piece.endswith(b"\n"):
            assert len(piece) - (piece.rfind(b"\n") + 1) >= max_line
    out.append(splitter.flush())
    assert b"".join(out) == b"".join(chunks)
    assert time.thread_time() - started < 0.05


@fuzz_target("rank_output", 200)
@given(st.binary(min_size=1, max_size=2000), st.binary(max_size=20))
def test_fuzz_prefixed(data: bytes, prefix: bytes) -> None:
    """Every line (a last one without its newline too) after the prefix, ending with one."""
    body = data[:-1] if data.endswith(b"\n") else data
    expected = b"".join(prefix + line + b"\n" for line in body.split(b"\n"))
    assert prefixed(prefix, data) == (expected if prefix else data)


def test_one_huge_feed_is_linear() -> None:
    """8 MiB without a newline in 1-byte feeds is linear (no copy of the carry per feed)."""
    splitter = LineSplitter()
    started = time.monotonic()
    total = 0
    for _ in range(200_000):
        total += len(splitter.feed(b"q"))
    total += len(splitter.flush())
    assert total == 200_000
    assert time.monotonic() - started < 2.0


async def test_a_paused_daemon_holds_no_print_within_the_pipe(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """The daemon SIGSTOPped: a rank prints 512 KiB (under its 1 MiB pipe) without waiting for
    it; once the daemon runs again every line reaches the file, whole."""
    ready, go, printed, end = (tmp_path / name for name in ("ready", "go", "printed", "end"))
    script = tmp_path / "paused.py"
    script.write_text(
        "import os, time\n"
        "from pathlib import Path\n"
        f"Path({str(ready)!r}).touch()\n"
        f"while not Path({str(go)!r}).exists(): time.sleep(0.01)\n"
        "for n in range(512): print(f'r0 a0 {n} ' + 'p' * (1017 - len(str(n))))\n"
        f"Path({str(printed)!r}).touch()\n"
        f"while not Path({str(end)!r}).exists(): time.sleep(0.01)\n"
    )
    run = await serve("--nproc-per-node", "1", "-r", "3", script=script)
    await await_files([ready], timeout=90)
    run.signal(signal.SIGSTOP)
    try:
        go.touch()
        await await_files([printed], timeout=30)  # printed while the daemon is stopped
    finally:
        run.signal(signal.SIGCONT)
    end.touch()
    assert await run.wait() == 0
    assert assert_whole_lines(run.attempt_dir(0) / "0" / "stdout.log", 0, 0) == 512


def test_the_pipe_is_raised_to_a_mebibyte() -> None:
    read_fd, write_fd = os.pipe()
    try:
        limit = int(Path("/proc/sys/fs/pipe-max-size").read_text())
        # Root may go past pipe-max-size; another user gets what it allows.
        assert grow_pipe(write_fd) == (1 << 20 if AS_ROOT else min(1 << 20, limit))
    finally:
        os.close(read_fd)
        os.close(write_fd)
