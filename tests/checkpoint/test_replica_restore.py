"""A lost node's ranks restored from the replica its successor held (ftd/checkpoint/replication.py):
two daemons of one rank each (under c10d and etcd), node b's daemon and rank SIGKILLed mid-run,
a new node c in its place; the job finishes bit-identical to a run that never failed, c's rank
restored from a's replica of b's snapshots."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from ftd.cli.status_view import checkpoint_text
from tests.conftest import (
    MEMORY_TRAIN,
    MEMORY_TRAIN_STEPS,
    Backend,
    Serve,
    ServeFactory,
    events_in,
)
from tests.support.api import CONTRACT
from tests.support.cluster import Cluster, api, ranks_of, run_dir
from tests.support.snapshots import assert_identical

pytestmark = pytest.mark.timeout(240)

TRAIN = MEMORY_TRAIN
PRELOAD = ("--preload", "torch._dynamo")
STEPS = MEMORY_TRAIN_STEPS  # the reference run's (memory_train_reference)
PAUSE = 50


def resumed(out: Path, rank: int) -> list[str]:
    files = sorted(out.glob(f"resumed-*-{rank}"), key=lambda f: int(f.name.split("-")[1]))
    return [f.read_text() for f in files]


async def api_text(run: Serve, node: str, path: str) -> str:
    info = json.loads((run_dir(run, node) / "api.json").read_text())
    token = Path(info["token_file"]).read_text().strip()
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        aiohttp.ClientSession() as session,
        session.get(info["url"] + path, headers=headers) as got,
    ):
        return await got.text()


async def until(what: str, check: object, timeout: float = 60.0) -> None:
    """Wait for `check()` (a coroutine function returning a truth) to hold."""
    deadline = time.monotonic() + timeout
    while not await check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout:.0f} s: {what}")
        await asyncio.sleep(0.1)


async def test_a_lost_node_s_rank_is_restored_from_its_replica_bit_identical(
    serve: ServeFactory, tmp_path: Path, backend: Backend, memory_train_reference: Path
) -> None:
    """Under c10d node a hosts the store, so b is the node that can be lost; under etcd either
    could be (b here)."""
    env = {"OMP_NUM_THREADS": "1"}
    train = ("--steps", str(STEPS))
    nodes = Cluster(
        serve, "2", "--nproc-per-node", "1", "--max-restarts", "3",
        "--node-keepalive-timeout", "5", "--checkpoint-memory", "64M", backend=backend,
    )  # fmt: skip
    out = tmp_path / "nodes"
    args = ("--out", str(out), *train, "--pause-at-step", str(PAUSE))

    async def node(name: str) -> Serve:
        return await nodes.serve(
            "--node-id", name, *nodes.flags, *PRELOAD, script=TRAIN, script_args=args,
            run_id=nodes.job, env={**env, **(nodes.env or {})},
        )  # fmt: skip

    a = await node("a")
    await a.stderr.expect(nodes.backend.in_rendezvous)
    b = await node("b")
    paused = out / "paused"

    async def b_replicated() -> bool:
        """b's rank stopped in step 50, and a acknowledged b's snapshot of step 49."""
        if not paused.exists():
            return False
        _, status = await api(b, "b", "GET", "/v1/status")
        view = status.get("checkpoint") or {}
        replica = view.get("replica") if isinstance(view, dict) else None
        return isinstance(replica, dict) and replica["replicated_step"] == PAUSE - 1

    await until("b's snapshot of step 49 replicated on a", b_replicated, timeout=150)
    _, status = await api(b, "b", "GET", "/v1/status")
    view = status["checkpoint"]
    CONTRACT.conforms("NodeCheckpoint", view)
    assert isinstance(view, dict) and view["replica_lag_steps"] == 0
    assert view["replica"]["successor"] == "a" and view["replica"]["held"] >= 1
    assert ", replica on a 0 steps behind" in checkpoint_text(status)  # ftd status, ftd top
    metrics = await api_text(b, "b", "/metrics")
    assert "ftd_checkpoint_replica_lag_steps 0.0" in metrics
    b_ranks = ranks_of(b, "b")
    b.signal(signal.SIGKILL)
    for pid in b_ranks:  # the node's rank too (its daemon's orphan guard may be first)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    await a.stderr.expect("node b lost", timeout=60)
    c = await node("c")
    codes = await asyncio.gather(a.wait(180), c.wait(180))
    runs = {"a": a, "c": c}
    assert codes == [0, 0], {n: r.stderr.text[-4000:] for n, r in runs.items()}
    for rank in (0, 1):
        assert resumed(out, rank) == ["none", str(PAUSE - 1)]
        assert_identical(memory_train_reference / f"final-{rank}.pt", out / f"final-{rank}.pt")
    (pulled,) = [e["data"] for e in events_in(run_dir(c, "c"), "replica_pulled")]
    assert pulled["global_rank"] == 1 and pulled["source"] == ["a"]
    assert PAUSE - 1 in pulled["steps"]
    restored = [e["data"] for e in events_in(run_dir(c, "c"), "checkpoint_restored")]
    assert [(e["global_rank"], e["step"]) for e in restored] == [(1, PAUSE - 1)]
    assert not events_in(run_dir(a, "a"), "replica_refused")
    assert not events_in(run_dir(c, "c"), "replica_refused")
