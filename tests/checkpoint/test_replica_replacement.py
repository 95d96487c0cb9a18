"""Issue 39 row 13 on live daemons: a replacement node of ten ranks restores every rank's
snapshot from its peer's replicas. Before, its ten pulls met the peer's cap of eight
connections, the refused ones were lost, and their ranks restarted from nothing though a
replica existed; now the pulls toward one peer are four at a time, retried with back-off."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BIN, Serve, ServeFactory
from tests.support.cluster import JOB_SECRET, Attacker, Cluster, api

pytestmark = pytest.mark.timeout(180)
RANKS = 10


async def until_files(paths: list[Path], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths):
        assert time.monotonic() < deadline, [p.name for p in paths if not p.exists()]
        await asyncio.sleep(0.05)


async def node(nodes: Cluster, name: str, out: Path) -> Serve:
    """A node of the job whose ranks are tests/bin/replica_restore_rank.py, writing to `out`."""
    return await nodes.serve(
        "--node-id", name, *nodes.flags, script=BIN / "replica_restore_rank.py",
        script_args=(str(out),), run_id=nodes.job, env=nodes.env,
    )  # fmt: skip


async def two_nodes(nodes: Cluster, out: Path) -> tuple[Serve, Serve]:
    """Nodes a (node rank 0, the store's host) and b."""
    out.mkdir()
    a = await node(nodes, "a", out)
    await a.stderr.expect(nodes.backend.in_rendezvous)
    return a, await node(nodes, "b", out)


async def test_a_replacement_node_of_ten_ranks_gets_every_replica(
    serve: ServeFactory, tmp_path: Path
) -> None:
    nodes = Cluster(
        serve, "2", "--nproc-per-node", str(RANKS), "--checkpoint-memory", "512M",
        "--preload", "none", "--max-restarts", "2",
    )  # fmt: skip
    out = tmp_path / "out"
    a, b = await two_nodes(nodes, out)
    await until_files([out / f"saved-{rank}" for rank in range(2 * RANKS)])
    await replicated(b, "b", 1)  # b's snapshots are on a: a acknowledged them
    b.signal(signal.SIGKILL)
    await b.wait()
    again = await node(nodes, "c", out)  # a new node in b's place: it holds nothing of b's
    assert await a.wait(timeout=120) == 0, a.stderr.text[-3000:]
    assert await again.wait(timeout=60) == 0, again.stderr.text[-3000:]
    restored = {
        rank: json.loads((out / f"restored-{rank}.json").read_text())
        for rank in range(RANKS, 2 * RANKS)
    }
    lost = {rank: reply for rank, reply in restored.items() if reply.get("steps") != [1]}
    assert not lost, lost


async def replicated(run: Serve, node: str, step: int, timeout: float = 120.0) -> dict[str, Any]:
    """The node's `checkpoint.replica` once its successor acknowledged `step`."""
    await run.stderr.expect(r"API listening on", timeout=timeout)
    deadline = time.monotonic() + timeout
    while True:
        _, status = await api(run, node, "GET", "/v1/status")
        checkpoint: dict[str, Any] = status.get("checkpoint") or {}  # type: ignore[assignment]
        replica: dict[str, Any] = checkpoint.get("replica") or {}
        if replica.get("replicated_step") == step:
            return replica
        assert time.monotonic() < deadline, checkpoint
        await asyncio.sleep(0.1)


async def test_a_malformed_summary_in_the_store_stops_no_push(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """Issue 39 row 14 on live daemons: a summary of node a's, signed with the job's key (a
    daemon of the job with a bug, or the key's holder) but naming a replica server that is no
    address, is refused by b (counted) and b's pushes go on: its next snapshot reaches a.
    Before, the ValueError ended b's push loop for good."""
    from ftd.coordination.records import NodeSummary, RecordCodec

    nodes = Cluster(serve, "2", "--checkpoint-memory", "128M", "--preload", "none")
    out = tmp_path / "out"
    a, b = await two_nodes(nodes, out)
    await replicated(b, "b", 1)
    codec = RecordCodec(nodes.job, JOB_SECRET.encode())
    forged = NodeSummary(
        node_id="a", state="running", attempt=0, restart_count=0, group_rank=0,
        nproc_per_node=1, time=time.time() + 1, replica_addr="127.0.0.1:notaport",
    )  # fmt: skip
    attacker = Attacker(nodes.endpoint, nodes.job)
    # Read (and refused) by the nodes' next looks at the summaries: a says so. a's own next
    # summary overwrites the forgery, maybe before any look on a busy machine: the attacker
    # writes it again until it was read.
    deadline = time.monotonic() + 120
    while True:
        attacker.set("status/a", codec.encode("status/a", forged))
        with contextlib.suppress(TimeoutError):
            await a.stderr.expect(r"refused node a's summary \(bad_address\)", timeout=1)
            break
        assert time.monotonic() < deadline, "a never read the forged summary"
    (out / "save-2").touch()
    await replicated(b, "b", 2)
    for run in (a, b):  # a's end ends b too (a hosts the store): b may be gone already
        with contextlib.suppress(ProcessLookupError):
            run.signal(signal.SIGTERM)
        await run.wait()
    assert "Traceback" not in a.stderr.text + b.stderr.text
