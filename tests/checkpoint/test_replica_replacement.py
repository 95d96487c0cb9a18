"""Issue 39 row 13 on live daemons: a replacement node of ten ranks restores every rank's
snapshot from its peer's replicas. Before, its ten pulls met the peer's cap of eight
connections, the refused ones were lost, and their ranks restarted from nothing though a
replica existed; now the pulls toward one peer are four at a time, retried with back-off."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import BIN, Serve, ServeFactory
from tests.support.cluster import Cluster, api

pytestmark = pytest.mark.timeout(180)
RANKS = 10


async def until_files(paths: list[Path], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths):
        assert time.monotonic() < deadline, [p.name for p in paths if not p.exists()]
        await asyncio.sleep(0.05)


async def test_a_replacement_node_of_ten_ranks_gets_every_replica(
    serve: ServeFactory, tmp_path: Path
) -> None:
    nodes = Cluster(
        serve, "2", "--nproc-per-node", str(RANKS), "--checkpoint-memory", "512M",
        "--preload", "none", "--max-restarts", "2",
    )  # fmt: skip
    out = tmp_path / "out"
    out.mkdir()

    async def node(name: str) -> Serve:
        return await nodes.serve(
            "--node-id", name, *nodes.flags, script=BIN / "replica_restore_rank.py",
            script_args=(str(out),), run_id=nodes.job, env=nodes.env,
        )  # fmt: skip

    a = await node("a")
    await a.stderr.expect(nodes.backend.in_rendezvous)
    b = await node("b")
    await until_files([out / f"saved-{rank}" for rank in range(2 * RANKS)])
    # b's snapshots are on a once a acknowledged them (b's status says so).
    deadline = time.monotonic() + 60
    while True:
        _, status = await api(b, "b", "GET", "/v1/status")
        replica = (status.get("checkpoint") or {}).get("replica") or {}  # type: ignore[union-attr]
        if replica.get("replicated_step") == 1:
            break
        assert time.monotonic() < deadline, status.get("checkpoint")
        await asyncio.sleep(0.1)
    b.signal(signal.SIGKILL)
    await b.wait()
    again = await node("c")  # a new node in b's place: it holds nothing of b's ranks
    assert await a.wait(timeout=120) == 0, a.stderr.text[-3000:]
    assert await again.wait(timeout=60) == 0, again.stderr.text[-3000:]
    restored = {
        rank: json.loads((out / f"restored-{rank}.json").read_text())
        for rank in range(RANKS, 2 * RANKS)
    }
    lost = {rank: reply for rank, reply in restored.items() if reply.get("steps") != [1]}
    assert not lost, lost
