"""The case host time is for, on real subprocess ranks: two DDP ranks of tests/bin/plain_ddp.py
observed as `ftd serve` observes them (script_boot.py, FTD_PROGRESS=1), rank 1's batches each
80 ms late (--slow-data-rank). DDP makes both ranks' steps equally long and the wait is outside
the forward; only `host_us` tells the ranks apart. The test plays the daemon's socket."""

from __future__ import annotations

import os
import selectors
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from ftd_client import protocol, wire

from tests.conftest import BIN, ROOT
from tests.support.ports import free_port
from tests.support.wire import fields

SLOW_DATA_MS = 80
STEPS = 30

pytestmark = pytest.mark.timeout(240)


def peer_pid(connection: socket.socket) -> int:
    credentials = connection.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
    )
    pid: int = struct.unpack("3i", credentials)[0]
    return pid


def last_reports(
    listener: socket.socket, ranks: list[subprocess.Popen[bytes]]
) -> dict[int, dict[str, Any]]:
    """Every report the ranks send until they exit (each sends its last at exit): the last
    report of each rank, by its pid."""
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    last: dict[int, dict[str, Any]] = {}
    open_connections = 0
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline:
        exited = all(rank.poll() is not None for rank in ranks)
        if exited and not open_connections:
            break
        for key, _ in selector.select(timeout=1.0):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if sock is listener:
                connection, _ = listener.accept()
                selector.register(connection, selectors.EVENT_READ, peer_pid(connection))
                open_connections += 1
                continue
            data = sock.recv(protocol.MAX_MESSAGE_BYTES)
            if not data:  # the rank's observer closed its link at exit
                selector.unregister(sock)
                sock.close()
                open_connections -= 1
                continue
            last[key.data] = fields(wire.decode(data))
    selector.close()
    return last


def test_a_rank_with_slow_data_has_the_longer_host_time(tmp_path: Path) -> None:
    path = str(tmp_path / "ranks.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(4)
    base = {
        **os.environ,
        "FTD_PROGRESS": "1",
        "FTD_SOCKET": path,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "PYTHONPATH": f"{ROOT}:{ROOT / 'client'}",
    }
    script = (
        *(str(BIN / "plain_ddp.py"), "--steps", str(STEPS), "--step-time", "0"),
        *("--ckpt-every", "1000", "--ckpt-dir", str(tmp_path / "ckpt")),
        *("--slow-data-rank", "1", "--slow-data-ms", str(SLOW_DATA_MS)),
    )
    boot = str(ROOT / "ftd" / "ranks" / "spawn" / "script_boot.py")
    ranks = [
        subprocess.Popen(
            [sys.executable, "-u", boot, *script],
            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
        )
        for rank in range(2)
    ]
    try:
        reports = last_reports(listener, ranks)
        outputs = [rank.communicate(timeout=60)[0].decode() for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
        listener.close()
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    assert all(f"finished {STEPS} steps" in output for output in outputs), outputs
    fast, slow = (reports[rank.pid] for rank in ranks)
    assert fast["steps"] == slow["steps"] == STEPS, reports
    assert slow["host_us"] >= SLOW_DATA_MS * 1000, reports
    assert slow["host_us"] - fast["host_us"] >= SLOW_DATA_MS * 1000 / 2, reports
    # The wait is outside the forward: the slow rank's forward is not the longer by as much.
    assert slow["fwd_us"] < fast["fwd_us"] + SLOW_DATA_MS * 1000 / 2, reports
