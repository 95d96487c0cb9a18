"""The replica server (ftd/checkpoint/replica_server.py) on a real loopback port, against a peer
that follows the protocol and peers that do not: a forged frame, a body that is not the one its
signed header names, a snapshot whose header lies, a frame for another node, an oversized one,
a flood of connections. Each is a counted refusal with an event naming its source, and the
replica kept before stays whole and is what a pull returns."""

from __future__ import annotations

import asyncio
import hashlib
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ftd_client.snapshot_format import HEADER_BYTES, layout

from ftd.checkpoint.ledger import Ledger
from ftd.checkpoint.replica_client import fetch
from ftd.checkpoint.replica_frame import MAGIC, PREFIX, VERSION, FrameError, FrameHeader, encode
from ftd.checkpoint.replica_server import MAX_CONNECTIONS, ReplicaServer
from ftd.checkpoint.replica_store import ReplicaStore
from ftd.checkpoint.replica_wire import client_handshake, read_header, send
from ftd.status.events import EventLog

KEY = hashlib.sha256(b"the job's replica key").digest()
BUDGET = 1 << 20


def snapshot(step: int, rank: int, world: int, fill: int = 7) -> bytes:
    header = layout(step, world, rank, 100, 1000)
    body = header.pack().ljust(HEADER_BYTES, b"\0") + bytes([fill]) * 100
    return body.ljust(header.total_bytes, bytes([fill]))


def frame(
    body: bytes,
    step: int = 1,
    rank: int = 1,
    world: int = 2,
    to: str = "a",
    key: bytes = KEY,
    digest_of: bytes | None = None,
    kind: str = "push",
    source: str = "b",
    round_: int = 0,
    echo: str = "0" * 32,
) -> bytes:
    header = FrameHeader(
        kind=kind,  # type: ignore[arg-type]
        source=source,
        to=to,
        rank=rank,
        world=world,
        step=step,
        round=round_,
        echo=echo,
        body_bytes=len(body),
        body_sha256=hashlib.sha256(body if digest_of is None else digest_of).hexdigest(),
    )
    return encode(key, header) + body


Frame = bytes | Callable[[str], bytes]
"""A frame's bytes, or made for the server's nonce of the connection."""


class Peer:
    """Node b, with the job's key: each exchange on a connection of its own, after the
    handshake (the server's challenge answered)."""

    def __init__(self, server: ReplicaServer) -> None:
        self.port = server.port

    async def exchange(self, data: Frame) -> FrameHeader | None:
        """Send `data`; the server's reply frame, or None when it closed the connection."""
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        except ConnectionError:
            return None
        try:
            mine, theirs = await client_handshake(reader, writer, KEY, "b", "a")
            writer.write(data(theirs) if callable(data) else data)
            await writer.drain()
            return await read_header(reader, KEY, "b", BUDGET, mine)
        except (EOFError, ConnectionError):
            return None
        finally:
            writer.close()

    async def pull(self, rank: int) -> list[tuple[FrameHeader, bytes]]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        got = []
        try:
            mine, theirs = await client_handshake(reader, writer, KEY, "b", "a")
            writer.write(frame(b"", kind="pull", rank=rank, echo=theirs))
            while (header := await read_header(reader, KEY, "b", BUDGET, mine)).kind != "end":
                got.append((header, await reader.readexactly(header.body_bytes)))
        finally:
            writer.close()
        return got


def pushed(body: bytes, **fields: Any) -> Callable[[str], bytes]:
    """A push frame of `body`, for the server's nonce."""
    return lambda nonce: frame(body, echo=nonce, **fields)


@pytest.fixture
async def served(tmp_path: Path) -> tuple[ReplicaServer, EventLog, Peer]:
    memory = tmp_path / "memory"
    memory.mkdir(mode=0o700)
    ledger = Ledger(BUDGET, agreement=True)
    ledger.pinned = True
    events = EventLog(None)
    server = ReplicaServer(KEY, "a", ReplicaStore(memory, ledger), events)
    await server.start("127.0.0.1")
    yield server, events, Peer(server)  # type: ignore[misc]
    await server.close()


async def test_a_pushed_snapshot_is_kept_privately_and_acknowledged(
    served: tuple[ReplicaServer, EventLog, Peer],
) -> None:
    server, _, peer = served
    ack = await peer.exchange(pushed(snapshot(1, 1, 2)))
    assert ack is not None and (ack.kind, ack.rank, ack.step, ack.to) == ("ack", 1, 1, "b")
    (kept,) = server.store.newest(1, 2, 8)
    assert (kept.step, kept.world, kept.path.read_bytes()) == (1, 2, snapshot(1, 1, 2))
    assert stat.S_IMODE(kept.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(kept.path.parent.stat().st_mode) == 0o700
    assert server.store.ledger.replica_bytes == len(snapshot(1, 1, 2))
    for step in (2, 3, 4):  # the newest three stay
        assert await peer.exchange(pushed(snapshot(step, 1, 2), step=step)) is not None
    assert [r.step for r in server.store.newest(1, 2, 8)] == [4, 3, 2]
    assert sorted(p.name for p in kept.path.parent.iterdir()) == [
        f"rank1.w2.s{step}" for step in (2, 3, 4)
    ]


async def test_forged_corrupt_oversized_and_flooding_peers_are_refused_and_the_replica_stays(
    served: tuple[ReplicaServer, EventLog, Peer],
) -> None:
    server, events, peer = served
    good = snapshot(1, 1, 2)
    assert await peer.exchange(pushed(good)) is not None
    other = hashlib.sha256(b"not the job's key").digest()
    liar = snapshot(3, 1, 2)  # a whole snapshot, of step 3, sent as step 2
    attacks: dict[str, Frame] = {
        "bad_signature": pushed(snapshot(2, 1, 2, fill=9), step=2, key=other),
        "corrupt": pushed(snapshot(2, 1, 2, fill=9), step=2, digest_of=snapshot(2, 1, 2)),
        "misdirected": pushed(snapshot(2, 1, 2), step=2, to="c"),
        # a prefix announcing more than the budget: refused before its header is read
        "oversized": PREFIX.pack(MAGIC, VERSION, 0, 100, BUDGET + 1, b"\0" * 32),
        "malformed": b"GET / HTTP/1.1\r\nHost: a\r\n\r\n".ljust(PREFIX.size, b" "),
    }
    attempts: list[tuple[str, Frame]] = [*attacks.items(), ("corrupt", pushed(liar, step=2))]
    for cause, data in attempts:
        assert await peer.exchange(data) is None, cause
        assert server.refused[cause] >= 1, (cause, dict(server.refused))
    flood = [await asyncio.open_connection("127.0.0.1", peer.port) for _ in range(MAX_CONNECTIONS)]
    await asyncio.sleep(0)
    for _ in range(100):  # the server saw them all: one more is closed at once
        if len(server._connections) == MAX_CONNECTIONS:
            break
        await asyncio.sleep(0.01)
    assert await peer.exchange(pushed(good)) is None
    assert server.refused["too_many_connections"] == 1
    for _, writer in flood:
        writer.close()
    refused = [e.data for e in events.since(0) if e.kind == "replica_refused"]
    assert {e["reason"] for e in refused} == {*attacks, "too_many_connections"}
    assert all(e["source"].startswith("127.0.0.1:") for e in refused)
    (kept,) = server.store.newest(1, 2, 8)  # the older replica, whole, is what a pull returns
    assert kept.step == 1 and kept.path.read_bytes() == good
    for _ in range(100):
        if not server._connections:
            break
        await asyncio.sleep(0.01)
    pulled = await peer.pull(1)
    assert [(h.kind, h.step, h.rank, h.world, body) for h, body in pulled] == [
        ("snapshot", 1, 1, 2, good)
    ]
    assert list(server.store.directory.iterdir()) == [kept.path]  # no partial body left


async def test_a_pull_keeps_only_whole_snapshots_of_the_rank_asked_for(
    served: tuple[ReplicaServer, EventLog, Peer], tmp_path: Path
) -> None:
    """The pulling side (replica_client.fetch): a peer's replicas, verified whole; a peer that
    answers with a body other than the one its header names, or another rank's snapshot, is
    refused and leaves nothing behind in the puller's memory."""
    server, _, peer = served
    ack = await peer.exchange(pushed(snapshot(5, 1, 2), step=5))
    assert ack is not None, dict(server.refused)
    memory = tmp_path / "puller"
    memory.mkdir(mode=0o700)
    store = ReplicaStore(memory, Ledger(BUDGET, agreement=True))
    address = f"127.0.0.1:{peer.port}"
    [(step, incoming)] = await fetch(KEY, "b", "a", address, 1, 2, store)
    assert step == 5 and incoming.path.read_bytes() == snapshot(5, 1, 2)
    incoming.discard()
    store.release(incoming)

    async def liar(answer: Callable[[str], bytes]) -> str:
        """A server with the key, node a's, that answers a pull with `answer`."""

        async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            hello = await read_header(reader, KEY, "a", 0, None)
            challenge = FrameHeader(
                kind="challenge", source="a", to="b", nonce="1" * 32, echo=hello.nonce
            )
            await send(writer, KEY, challenge)
            await read_header(reader, KEY, "a", 0, "1" * 32)
            writer.write(answer(hello.nonce))
            await writer.drain()
            writer.close()

        fake = await asyncio.start_server(reply, "127.0.0.1", 0)
        servers.append(fake)
        return f"127.0.0.1:{fake.sockets[0].getsockname()[1]}"

    servers: list[asyncio.Server] = []
    answers = {
        "corrupt": pushed(
            snapshot(6, 1, 2, fill=9),
            step=6,
            digest_of=snapshot(6, 1, 2),
            to="b",
            source="a",
            kind="snapshot",
        ),
        "unexpected": pushed(
            snapshot(6, 0, 2), step=6, rank=0, to="b", source="a", kind="snapshot"
        ),
    }
    for cause, answer in answers.items():
        with pytest.raises(FrameError) as refused:
            await fetch(KEY, "b", "a", await liar(answer), 1, 2, store)
        assert refused.value.cause == cause, refused.value
    assert list(store.directory.iterdir()) == [] and store.ledger.replica_bytes == 0
    for fake in servers:
        fake.close()


def test_replicas_only_for_a_job_of_several_nodes_with_a_secret_and_a_memory_tier(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """Unsigned replicas would let anyone who reaches the port plant a rank's state: without
    the job secret nothing is replicated, and the daemon says so once, with why."""
    from ftd.checkpoint.holder import CheckpointHolder
    from ftd.checkpoint.replication import Replication, replication_for
    from ftd.config.serve import ServeConfig
    from ftd.coordination.records import RecordCodec

    class Coordinator:
        def __init__(self, secret: bytes | None) -> None:
            self.codec = RecordCodec("job", secret)
            self.round = None

    def config(nnodes: int, memory: int | None = None) -> ServeConfig:
        return ServeConfig(
            entrypoint=__file__,
            nnodes_min=nnodes,
            nnodes_max=nnodes,
            node_id="a",
            rdzv_endpoint="127.0.0.1:1",
            checkpoint_memory_bytes=memory,
        )

    events = EventLog(None)
    signed = Coordinator(b"the job's secret, 16+ bytes")

    def replicas(nnodes: int, coordinator: Coordinator, memory: int | None = None) -> object:
        built = replication_for(config(nnodes, memory), coordinator, events, None, print)  # type: ignore[arg-type]
        return built(CheckpointHolder(tmp_path, 1 << 20, events)) if built else None

    assert isinstance(replicas(2, signed), Replication)
    assert replicas(1, signed) is None
    assert replicas(2, signed, 0) is None
    with caplog.at_level("INFO", logger="ftd.checkpoint"):
        assert replicas(2, Coordinator(None)) is None
    (said,) = [r.getMessage() for r in caplog.records if "not replicated" in r.getMessage()]
    assert "no secret to sign them" in said


async def test_a_newer_round_replaces_the_replicas_from_its_step_and_an_older_one_is_stale(
    served: tuple[ReplicaServer, EventLog, Peer],
) -> None:
    """After a restore the job redoes steps: a replica of a newer round replaces the held ones
    from its step on (they were another history); one of an older round is refused."""
    server, _, peer = served
    for step in (5, 6, 7):
        assert await peer.exchange(pushed(snapshot(step, 1, 2), step=step)) is not None
    assert await peer.exchange(pushed(snapshot(6, 1, 2, fill=3), step=6, round_=1)) is not None
    assert [(r.step, r.path.read_bytes()[-1]) for r in server.store.newest(1, 2, 8)] == [
        (6, 3),
        (5, 7),
    ]
    assert await peer.exchange(pushed(snapshot(8, 1, 2), step=8)) is None
    assert server.refused["stale"] == 1
