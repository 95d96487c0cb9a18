"""Stragglers across nodes: two `ftd serve` daemons of one job on this machine (c10d store, one
rank each); rank 1, on node b, runs its forward 60 ms slower. b judges it against a's rank,
whose forward times a publishes in its summary, and GET /v1/cluster on either node names it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tests.conftest import BIN, ServeFactory, events_in
from tests.support.cluster import Cluster, api, run_dir

PLAIN_DDP = BIN / "plain_ddp.py"
STRAGGLING = ("--steps", "100000", "--ckpt-every", "100000", "--step-time", "0.01")
SLOW_RANK_1 = ("--slow-forward-rank", "1", "--slow-forward-ms", "60")


async def cluster_stragglers(run: Any, node: str, timeout: float = 30.0) -> list[Any]:
    """GET /v1/cluster's stragglers once it lists some (b publishes its summary without waiting
    for the store, so a's view may trail b's event by a write)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        code, view = await api(run, node, "GET", "/v1/cluster")
        assert code == 200, view
        stragglers = view["stragglers"]
        assert isinstance(stragglers, list)
        if stragglers or loop.time() > deadline:
            return stragglers
        await asyncio.sleep(0.2)


async def test_two_daemons_show_the_other_nodes_straggler_in_the_cluster_view(
    serve: ServeFactory, tmp_path: Path
) -> None:
    cluster = Cluster(serve, "2", "--nproc-per-node", "1", "--max-restarts", "0")

    async def node(node_id: str) -> Any:
        args = (*STRAGGLING, *SLOW_RANK_1, "--ckpt-dir", str(tmp_path / node_id))
        return await serve(
            "--node-id", node_id, *cluster.flags, run_id=cluster.job, env=cluster.env,
            script=PLAIN_DDP, script_args=args,
        )  # fmt: skip

    a = await node("a")
    await a.stderr.expect(cluster.backend.in_rendezvous)  # a is node rank 0: rank 0 is a's
    b = await node("b")
    await b.stderr.expect(r"straggler: rank 1's forward pass takes", timeout=150)
    [event] = events_in(run_dir(b, "b"), "straggler")
    data = event["data"]
    assert data["global_rank"] == 1 and data["node_id"] == "b", data
    assert data["median_s"] < 0.05 < data["forward_s"], data  # the median is a's rank 0
    assert event["time"] - data["since"] < 30, (event, data)
    for run, name in ((a, "a"), (b, "b")):
        [named] = await cluster_stragglers(run, name)
        assert named["node_id"] == "b" and named["global_rank"] == 1, named
        assert named["ratio"] >= 1.2 and named["since"] == data["since"], named
    assert events_in(run_dir(a, "a"), "straggler") == []
