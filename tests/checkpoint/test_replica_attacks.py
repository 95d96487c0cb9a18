"""The replica channel's boundary (docs/checkpoint.md, "A replica on a peer node"), each audit row
on real loopback sockets, real replica servers and a real holder and `Replication` per node:

- row 4: a rank's restores (`ckr`) in thousands of worlds start one pull, not thousands, and
  the peer's connections stay free for the pushes;
- row 5: a captured pull replayed on another connection reads nothing; a peer that reads nothing
  of its answer (or sends nothing) loses its connection in bounded time, and a replica trimmed
  while it was being sent counts against the memory budget until its file is closed;
- row 13: a replacement node of 10 ranks, its peer's connections nearly all taken, still gets
  every rank's replica (pulls bounded per peer and retried);
- row 14: a summary with a malformed `replica_addr` or an older one played back changes nothing
  and the push loop goes on; a squatter on the summary's port gets no snapshot;
- row 3: a FIFO planted in a rank's slot is refused at once, no thread waits on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from ftd_client import protocol
from ftd_client.wire import Message

from ftd.checkpoint import replica_pull, replica_server, replica_wire, replication
from ftd.checkpoint.holder import CheckpointHolder
from ftd.checkpoint.ledger import Ledger
from ftd.checkpoint.replica_client import fetch
from ftd.checkpoint.replica_server import MAX_CONNECTIONS, ReplicaServer
from ftd.checkpoint.replica_store import ReplicaStore
from ftd.checkpoint.replica_wire import client_handshake, read_header
from ftd.checkpoint.replication import Replication
from ftd.status.events import EventLog
from tests.checkpoint.test_replica_server import KEY, frame, snapshot
from tests.support.wire import message

BUDGET = 64 << 20
pytestmark = pytest.mark.timeout(60)


async def until(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout:.0f} s: {what}")
        await asyncio.sleep(0.02)


class Peers:
    """What the rendezvous store answers for the members' summaries, as a JobShare of the
    round's node rank 0 (which reads every summary on every look)."""

    def __init__(self) -> None:
        self.nodes: list[dict[str, Any]] = []
        self.reads = 0

    def say(self, node_id: str, address: str | None, at: float) -> None:
        self.nodes = [n for n in self.nodes if n["node_id"] != node_id]
        self.nodes.append({"node_id": node_id, "replica_addr": address, "time": at})

    def leading(self) -> bool:
        return True

    async def every_summary(self) -> list[dict[str, Any]]:
        self.reads += 1
        return list(self.nodes)

    async def publish(self, name: str, values: dict[str, Any]) -> None:
        pass

    async def read(self, name: str) -> dict[str, Any] | None:
        return None

    async def summary_of(self, node_id: str) -> dict[str, Any] | None:
        return next((n for n in self.nodes if n["node_id"] == node_id), None)

    async def read_twice(self) -> None:
        """Until the nodes read the summaries twice more (each read wakes the pusher)."""
        now = self.reads
        await until("two more reads of the summaries", lambda: self.reads >= now + 2)


async def a_server(tmp_path: Path, node_id: str = "a") -> ReplicaServer:
    memory = tmp_path / f"memory-{node_id}"
    memory.mkdir(mode=0o700)
    ledger = Ledger(BUDGET, agreement=True)
    ledger.pinned = True
    server = ReplicaServer(KEY, node_id, ReplicaStore(memory, ledger), EventLog(None))
    await server.start("127.0.0.1")
    return server


async def plant(port: int, rank: int, world: int, step: int, body: bytes | None = None) -> None:
    """Node b pushes its rank's snapshot to node a's server."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        mine, theirs = await client_handshake(reader, writer, KEY, "b", "a")
        data = body if body is not None else snapshot(step, rank, world)
        writer.write(frame(data, step=step, rank=rank, world=world, echo=theirs))
        ack = await read_header(reader, KEY, "b", 0, mine)
        assert (ack.kind, ack.step) == ("ack", step)
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def node(
    tmp_path: Path, me: str, members: list[str], ranks: range, world: int, peers: Peers
) -> AsyncIterator[tuple[Replication, CheckpointHolder]]:
    """A node's holder and replication, the round (1, `members`) and its `ranks` of `world`."""
    run_dir = tmp_path / me
    run_dir.mkdir()
    events = EventLog(None)

    def replication(holder: CheckpointHolder) -> Replication:
        view = lambda: (1, members, ranks, world)  # noqa: E731
        return Replication(KEY, me, events, view, peers, lambda: None, holder)  # type: ignore[arg-type]

    holder = CheckpointHolder(
        run_dir, BUDGET, events, multi_node=True, replicas=replication, base=run_dir
    )
    repl = holder.replicas
    assert isinstance(repl, Replication)
    holder.start()
    await holder.serve_replicas("127.0.0.1")
    try:
        yield repl, holder
    finally:
        await holder.close_replicas()
        holder.close()


def restore(world: int, request: int = 1) -> Message:
    return message({"v": 1, "t": protocol.CHECKPOINT_RESTORE, "id": request, "world": world})


def save(holder: CheckpointHolder, rank: int, step: int, world: int) -> Path:
    """A rank's complete snapshot of `step`; its slot's file."""
    data = snapshot(step, rank, world, fill=0x5A)
    begin = {
        "v": 1,
        "t": protocol.CHECKPOINT_BEGIN,
        "id": 1,
        "step": step,
        "bytes": len(data),
        "world": world,
    }
    grant = holder.answer(rank, message(begin))
    assert grant is not None and grant.get("path"), grant
    Path(grant["path"]).write_bytes(data)
    done = {"v": 1, "t": protocol.CHECKPOINT_DONE, "id": 2, "step": step, "slot": grant["slot"]}
    answer = holder.answer(rank, message(done))
    assert answer is not None and answer["ok"] is True, answer
    return Path(grant["path"])


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replication, "READ_S", 0.05)
    monkeypatch.setattr(replication, "FLOOR_S", 0.05)
    monkeypatch.setattr(replication, "RETRY_S", 0.05)
    monkeypatch.setattr(replication, "PUSH_TIMEOUT_S", 1.0)
    monkeypatch.setattr(replica_pull, "RETRY_S", 0.05)
    monkeypatch.setattr(replica_wire, "READ_TIMEOUT_S", 0.5)
    monkeypatch.setattr(replica_wire, "WRITE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(replica_server, "ANSWER_S", 5.0)


# -- row 4 and row 13: the pulls' budgets --------------------------------------------------


async def test_restores_in_thousands_of_worlds_start_one_pull_and_leave_the_peer_free(
    tmp_path: Path, fast: None
) -> None:
    a = await a_server(tmp_path)
    try:
        await plant(a.port, 1, 2, 7)
        peers = Peers()
        peers.say("a", f"127.0.0.1:{a.port}", 1.0)
        async with node(tmp_path, "c", ["a", "c"], range(1, 2), 2, peers) as (repl, holder):
            for world in range(2, 2002):  # the round's world (2) first, then 1999 others
                holder.answer(1, restore(world, world))
            await until(
                "rank 1's pull done", lambda: not holder.answer(1, restore(2)).get("pending")
            )
            assert holder.answer(1, restore(2))["steps"] == [7]
            assert a.refused["too_many_connections"] == 0, dict(a.refused)
            assert a.pulls == 1
            assert repl.refused["other_world"] == 1999
            view = repl.view()["replica"]
            assert view["pulled"] == 1 and view["refused"] >= 1999
            await plant(a.port, 1, 2, 8)  # a real push still gets in
    finally:
        await a.close()


async def test_a_replacement_node_of_ten_ranks_gets_every_replica_through_a_busy_peer(
    tmp_path: Path, fast: None
) -> None:
    a = await a_server(tmp_path)
    held = []
    try:
        for rank in range(10):
            await plant(a.port, rank, 10, 5)
        held = [  # 6 of a's 8 connections taken (a push under way, a scan): 2 left
            await asyncio.open_connection("127.0.0.1", a.port) for _ in range(MAX_CONNECTIONS - 2)
        ]
        await until("a sees them", lambda: len(a._connections) == MAX_CONNECTIONS - 2)
        peers = Peers()
        peers.say("a", f"127.0.0.1:{a.port}", 1.0)
        async with node(tmp_path, "c", ["a", "c"], range(10), 10, peers) as (repl, holder):
            for rank in range(10):
                holder.answer(rank, restore(10))
            await until(
                "every rank's pull done",
                lambda: all(not holder.answer(r, restore(10)).get("pending") for r in range(10)),
            )
            steps = {rank: holder.answer(rank, restore(10))["steps"] for rank in range(10)}
            assert steps == {rank: [5] for rank in range(10)}, (steps, dict(repl.refused))
            assert repl.refused["pull_failed"] == 0
    finally:
        for _, writer in held:
            writer.close()
        await a.close()


# -- row 5: replays, unread answers, trimmed files ----------------------------------------------


async def test_a_captured_pull_replayed_on_another_connection_reads_nothing(
    tmp_path: Path, fast: None
) -> None:
    a = await a_server(tmp_path)
    secret = snapshot(3, 1, 2, fill=0xC3)
    captured = bytearray()

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Between node c and a: records what c sends."""
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", a.port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, log: bool) -> None:
            while data := await src.read(1 << 16):
                captured.extend(data if log else b"")
                dst.write(data)
                await dst.drain()
            dst.close()

        with contextlib.suppress(OSError):
            await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))

    tap = await asyncio.start_server(proxy, "127.0.0.1", 0)
    try:
        await plant(a.port, 1, 2, 3, secret)
        memory = tmp_path / "c"
        memory.mkdir(mode=0o700)
        store = ReplicaStore(memory, Ledger(BUDGET, agreement=True))
        tapped = f"127.0.0.1:{tap.sockets[0].getsockname()[1]}"
        [(step, incoming)] = await fetch(KEY, "c", "a", tapped, 1, 2, store)
        assert step == 3 and incoming.path.read_bytes() == secret
        assert captured
        reader, writer = await asyncio.open_connection("127.0.0.1", a.port)
        writer.write(bytes(captured))  # the whole conversation, played again
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert secret[-4096:] not in answer and len(answer) < len(secret)
        assert a.refused["replayed"] == 1 and a.pulls == 1, dict(a.refused)
    finally:
        tap.close()
        await a.close()


def open_deleted(directory: Path) -> list[str]:
    """This process's open files that were in `directory` and are gone."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(directory)) and target.endswith("(deleted)"):
                found.append(target)
    return found


async def test_unread_answers_lose_their_connection_and_a_trimmed_replica_stays_counted(
    tmp_path: Path, fast: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replica_wire, "WRITE_TIMEOUT_S", 3.0)  # the trim comes well before
    # 16 MiB checked and written before its ack: on a busy machine that takes more than the
    # `fast` half second, and a silent connection is closed after this all the same
    monkeypatch.setattr(replica_wire, "READ_TIMEOUT_S", 3.0)
    a = await a_server(tmp_path)
    size = 16 << 20  # far over what the sockets' buffers take: the answer waits on its reader
    try:
        await plant(a.port, 1, 2, 1, snapshot(1, 1, 2).ljust(size, b"\x07"))
        readers = []
        for _ in range(2):  # pulls asked, then never read
            reader, writer = await asyncio.open_connection("127.0.0.1", a.port)
            _, theirs = await client_handshake(reader, writer, KEY, "b", "a")
            writer.write(frame(b"", kind="pull", rank=1, echo=theirs))
            readers.append((reader, writer))
        silent = await asyncio.open_connection("127.0.0.1", a.port)  # says nothing at all
        await until("a answers both", lambda: a.pulls == 2)
        for step in (2, 3, 4):  # step 1 is trimmed while it is being sent
            await plant(a.port, 1, 2, step)
        assert [r.step for r in a.store.newest(1, 2, 8)] == [4, 3, 2]
        held = sum(r.nbytes for r in a.store.newest(1, 2, 8))
        assert a.store.ledger.replica_bytes == held + size  # still open: still memory, counted
        await until("the unread and silent connections closed", lambda: not a._connections)
        assert a.refused["timeout"] >= 1, dict(a.refused)
        assert open_deleted(a.store.directory) == []
        assert a.store.ledger.replica_bytes == held
        assert await asyncio.wait_for(silent[0].read(), 5) == b""
        for _, writer in [*readers, silent]:
            writer.close()
    finally:
        await a.close()


# -- row 14: the summaries, the push loop, a squatter ------------------------------------------


class Squatter:
    """Someone else's listener on the port an old summary names: it reads what comes."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._take, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _take(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        with contextlib.suppress(OSError):
            while data := await reader.read(1 << 16):
                self.received.extend(data)
        writer.close()

    def close(self) -> None:
        assert self.server is not None
        self.server.close()


async def test_a_malformed_or_played_back_summary_changes_nothing_and_the_pushes_go_on(
    tmp_path: Path, fast: None
) -> None:
    a = await a_server(tmp_path)
    squatter = Squatter()
    taken = await squatter.start()
    peers = Peers()
    try:
        async with node(tmp_path, "b", ["a", "b"], range(1, 2), 2, peers) as (repl, holder):
            save(holder, 1, 4, 2)
            peers.say("a", "127.0.0.1:notaport", 10.0)  # malformed: refused, the loop goes on
            await peers.read_twice()
            peers.say("a", f"127.0.0.1:{a.port}", 30.0)
            await until("a acknowledged step 4", lambda: repl.acked == [4])
            peers.say("a", taken, 20.0)  # an older summary of a's, played back
            await peers.read_twice()
            save(holder, 1, 5, 2)
            await until("a acknowledged step 5", lambda: repl.acked == [4, 5])
            assert repl.ring.addresses["a"] == f"127.0.0.1:{a.port}"
            assert squatter.connections == 0 and a.pushes == 2
            assert repl.refused["bad_address"] >= 1 and repl.refused["stale_summary"] >= 1
    finally:
        squatter.close()
        await a.close()


async def test_a_squatter_on_the_summary_s_port_gets_no_snapshot(
    tmp_path: Path, fast: None
) -> None:
    """a's daemon went away and another user took its port before a's summary changed."""
    squatter = Squatter()
    peers = Peers()
    peers.say("a", await squatter.start(), 10.0)
    try:
        async with node(tmp_path, "b", ["a", "b"], range(1, 2), 2, peers) as (repl, holder):
            data = save(holder, 1, 4, 2).read_bytes()
            await until("pushes tried at the squatter", lambda: squatter.connections >= 2)
            assert data[-4096:] not in squatter.received and len(squatter.received) < 4096
            assert repl.acked == []
            assert repl.refused["timeout"] >= 1  # its silence to the handshake, counted
    finally:
        squatter.close()


# -- row 3: a FIFO in a rank's slot ------------------------------------------------------------


async def test_a_fifo_in_a_slot_is_refused_at_once_and_takes_no_thread(
    tmp_path: Path, fast: None
) -> None:
    a = await a_server(tmp_path)
    peers = Peers()
    peers.say("a", f"127.0.0.1:{a.port}", 1.0)
    fifo: Path | None = None
    try:
        async with node(tmp_path, "b", ["a", "b"], range(1, 2), 2, peers) as (repl, holder):
            slot = save(holder, 1, 4, 2)
            threads = threading.active_count()
            slot.unlink()
            os.mkfifo(slot, 0o600)  # what a rank can plant: no writer ever opens it
            fifo = slot
            waiting = []  # whether a reader of ours waits on the FIFO, looked at 5 times
            for _ in range(5):
                await peers.read_twice()
                waiting.append(fifo_has_a_reader(fifo))
            assert not all(waiting), "a thread of the daemon waits on the FIFO"
            assert threading.active_count() <= threads + replica_wire.IO_THREADS
            assert a.pushes == 0 and repl.acked == []
            assert repl.refused["not_regular"] >= 3
    finally:
        if fifo is not None:  # a reader stuck on it (before the fix) is let go
            fifo_has_a_reader(fifo)
        await a.close()


def fifo_has_a_reader(fifo: Path) -> bool:
    """Opening its writing end without waiting succeeds only while a reader has it open (or
    waits in open); the reader then sees it closed at once."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        return False
    return True
