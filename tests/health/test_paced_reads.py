"""A rank client's connection that asks nothing is read a few times a second, not once a
heartbeat (ftd/health/socket.py, PACE_S): its heartbeats wait in the kernel, each stamped with
its time of sending, so the daemon judges by the same times; a drain reads them at once, and a
request makes the connection eager again. A real socket server on a real event loop."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ftd_client import protocol
from ftd_client.wire import Envelope

from ftd.health.links import Link
from ftd.health.socket import EAGER_S, PACE_S, RankSocketServer


class Heard:
    def __init__(self) -> None:
        self.messages: list[tuple[str, float, float]] = []
        """(kind, the time dispatch was given, when it was dispatched)."""
        self.arrived = asyncio.Event()

    def dispatch(self, link: Link, envelope: Envelope, at: float) -> dict[str, object] | None:
        self.messages.append((envelope.message.KIND, at, time.monotonic()))
        self.arrived.set()
        return {"ok": True} if envelope.id is not None else None

    async def until(self, count: int) -> None:
        while len(self.messages) < count:
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), 30)


def packet(message: dict[str, Any]) -> bytes:
    """`message` as a raw packet, written by hand as any sender may."""
    return json.dumps({"v": protocol.PROTOCOL_VERSION, **message}).encode()


def send(sock: socket.socket, message: dict[str, Any]) -> float:
    sock.send(packet(message))
    return time.monotonic()


@contextlib.asynccontextmanager
async def connected(
    tmp_path: Path, heard: Heard
) -> AsyncIterator[tuple[RankSocketServer, socket.socket]]:
    """A rank socket server on this loop, and a client connected to it."""
    server = RankSocketServer(tmp_path / "ftd.sock", heard.dispatch, lambda pid: None)
    server.start()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        client.connect(str(tmp_path / "ftd.sock"))
        yield server, client
    finally:
        client.close()
        server.close()


def beats_apart(client: socket.socket, numbers: tuple[int, ...], gap_s: float) -> list[float]:
    """Heartbeats `gap_s` apart, sent while the event loop is blocked here: the server cannot
    read any of them before the last is sent. When each was sent."""
    sent = []
    for seq in numbers:
        time.sleep(gap_s)
        sent.append(send(client, {"t": protocol.HEARTBEAT, "s": seq}))
    return sent


async def test_a_quiet_clients_heartbeats_are_read_in_batches_and_timed_when_sent(
    tmp_path: Path,
) -> None:
    heard = Heard()
    async with connected(tmp_path, heard) as (server, client):
        send(client, {"t": protocol.HELLO, "id": 1})
        await heard.until(1)
        assert client.recv(4096)  # answered at once: a new connection is eager
        await asyncio.sleep(EAGER_S)  # past its eager second (the rule under test)
        sent = [send(client, {"t": protocol.HEARTBEAT, "s": 1})]
        await heard.until(2)  # read at once (it was armed), then it rests
        [(fd, connection)] = server._connections.items()
        assert fd in server._resting
        sent += beats_apart(client, (2, 3, 4), 0.03)
        await heard.until(5)
        beats = heard.messages[1:]
        timed = [at for _, at, _ in beats]
        # Each is timed when it was sent (the kernel's stamp, before send returned), not when
        # the batch was read ...
        assert all(at <= when + 0.002 for at, when in zip(timed, sent, strict=True)), (timed, sent)
        assert all(b - a >= 0.025 for a, b in itertools.pairwise(timed[1:])), timed
        # ... and the last three were read after the last was sent, once the rest was over.
        read = [dispatched for _, _, dispatched in beats[1:]]
        assert min(read) >= sent[-1] and read[0] - beats[0][2] >= PACE_S - 0.01, (read, beats)

        # A drain reads a resting connection now (a verdict is due).
        assert fd in server._resting
        when = send(client, {"t": protocol.HEARTBEAT, "s": 5})
        server.drain()
        assert len(heard.messages) == 6 and heard.messages[-1][1] <= when + 0.002

        # A request is answered, and the connection is eager for a second after it.
        send(client, {"t": protocol.WORKLOAD_CONTROL, "a": "CONTINUE", "d": "", "s": 6, "id": 2})
        await heard.until(7)
        assert connection.eager_until > time.monotonic()
        assert client.recv(4096)


async def test_a_connection_that_never_said_hello_is_never_paced(tmp_path: Path) -> None:
    """The checkpoint link and the zero-code progress link wait on answers in the training
    loop (or carry their own times): read at once, always."""
    heard = Heard()
    async with connected(tmp_path, heard) as (server, client):
        send(client, {"t": protocol.HEARTBEAT, "s": 1})
        await heard.until(1)
        await asyncio.sleep(EAGER_S)
        send(client, {"t": protocol.HEARTBEAT, "s": 2})
        await heard.until(2)
        assert not server._resting
