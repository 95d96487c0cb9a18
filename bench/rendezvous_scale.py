"""Rendezvous at scale: N `ftd serve` daemons on one machine, trivial ranks.

For each N: the time for round 0 to close (last daemon entering the rendezvous -> last
`round_closed`), the restart propagation latency (node 0's restart request -> every other
daemon's `cluster_request`, i.e. woken and stopping its ranks), the time for the next round to
close after the restart, and the store operations per round (counted in-process by
`CountingStore`, join only, up to larger N with threads).

    python bench/rendezvous_scale.py --nodes 2 4 8 16 --ops-nodes 2 4 8 16 32 64 128 256

`--backend c10d etcd --runs 10` (rendezvous_backends.py): for each backend and N,
one job of N daemons restarted `--runs` times: median and max of the propagation and of
restart -> next round closed, over the runs (etcd: one real member started here).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, child_env

WORKER = ROOT / "tests" / "bin" / "worker.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def first(evs: list[dict[str, Any]], kind: str, **match: Any) -> dict[str, Any] | None:
    for event in evs:
        if event["kind"] == kind and all(event["data"].get(k) == v for k, v in match.items()):
            return event
    return None


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)  # the benchmark driver may poll files; the daemons do not


def one_size(n: int, keepalive: float) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"ftd_rdzv{n}_"))
    endpoint = f"127.0.0.1:{free_port()}"
    flags = [
        *("--nnodes", str(n), "--nproc-per-node", "1", "--rdzv-endpoint", endpoint),
        *("--rdzv-id", "bench", "--local-addr", "127.0.0.1", "--log-dir", str(work)),
        *("--node-keepalive-timeout", str(keepalive), "--api-port", "0"),
        *("--rdzv-join-timeout", "300"),
    ]
    procs = []
    for i in range(n):
        cmd = [sys.executable, "-m", "ftd", "serve", "--node-id", f"n{i:03d}", *flags]
        cmd += [str(WORKER), "--out", str(work / "out"), "--hang-attempts", "1"]
        log = (work / f"n{i:03d}.log").open("wb")
        procs.append(subprocess.Popen(cmd, env=child_env(), stdout=log, stderr=log))
        if i == 0:  # node 0 hosts the store
            wait_for(lambda: (work / "n000" / "bench" / "api.json").exists(), 120, "node 0")
    dirs = [work / f"n{i:03d}" / "bench" for i in range(n)]
    try:
        wait_for(
            lambda: all(first(events(d), "round_closed", round=0) for d in dirs), 600, "round 0"
        )
        evs = [events(d) for d in dirs]
        entered = max(
            e["time"] for ev in evs for e in ev if e["kind"] == "state_changed"
            and e["data"]["state"] == "rendezvous"
        )  # fmt: skip
        closed0 = [first(ev, "round_closed", round=0)["time"] for ev in evs]  # type: ignore[index]
        wait_for(
            lambda: all((work / "out" / f"ready_a0_r{r}").exists() for r in range(n)), 300, "ranks"
        )
        info = json.loads((dirs[0] / "api.json").read_text())
        token = Path(info["token_file"]).read_text().strip()
        request = urllib.request.Request(
            info["url"] + "/v1/restart",
            data=json.dumps({"reason": "bench", "count": False}).encode(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(request, timeout=30).read()
        codes = [p.wait(timeout=600) for p in procs]
        evs = [events(d) for d in dirs]
        asked = first(evs[0], "restart_requested")
        assert asked is not None
        woken = [first(ev, "cluster_request", round=0) for ev in evs[1:]]
        latencies = [(w["time"] - asked["time"]) * 1000 for w in woken if w]
        closed1 = [first(ev, "round_closed", round=1) for ev in evs]
        reclose = max(c["time"] for c in closed1 if c) - asked["time"]
        ops = [
            json.loads((d / "status.json").read_text()).get("state") for d in dirs
        ]  # fmt: skip
        return {
            "nodes": n,
            "exit_codes": sorted(set(codes)),
            "states": sorted(set(ops)),
            "round0_close_ms": round((max(closed0) - entered) * 1000, 1),
            "propagation_ms_median": round(statistics.median(latencies), 1),
            "propagation_ms_max": round(max(latencies), 1),
            "restart_to_round1_closed_ms": round(reclose * 1000, 1),
        }
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def ops_per_round(n: int) -> dict[str, Any]:
    """Store operations for N nodes to join and close one round (threads, one store)."""
    from ftd.rendezvous import CountingStore, Rendezvous, connect_store, host_store

    from ftd.config import ServeConfig

    port = free_port()
    server = host_store("127.0.0.1", port)
    counts: list[int] = []
    lock = threading.Lock()
    started = time.monotonic()

    def join(i: int) -> None:
        config = ServeConfig(
            entrypoint=str(WORKER),
            nnodes_min=n,
            nnodes_max=n,
            rdzv_endpoint=f"127.0.0.1:{port}",
            run_id="ops",
            node_id=f"n{i:04d}",
            local_addr="127.0.0.1",
        )
        rdzv = Rendezvous(config, lambda node, reason: None)
        rdzv._store = CountingStore(connect_store("127.0.0.1", port), rdzv.prefix, rdzv.ops)
        rdzv._join(time.monotonic() + 120)
        with lock:
            counts.append(rdzv.ops[0])

    threads = [threading.Thread(target=join, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    elapsed = time.monotonic() - started
    del server
    return {
        "nodes": n,
        "ops_total": sum(counts),
        "ops_per_node": round(sum(counts) / n, 2),
        "join_all_ms": round(elapsed * 1000, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, nargs="*", default=[2, 4, 8, 16])
    parser.add_argument("--ops-nodes", type=int, nargs="*", default=[2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--keepalive", type=float, default=5.0)
    parser.add_argument("--backend", nargs="*", choices=["c10d", "etcd"], default=[])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "client"))
    sys.path.insert(0, str(ROOT))
    if args.backend:
        from rendezvous_backends import restarts_in_one_job

        for n in args.nodes:
            for backend in args.backend:
                print(json.dumps(restarts_in_one_job(n, backend, args.runs)), flush=True)
        return
    for n in args.ops_nodes:
        print(json.dumps(ops_per_round(n)), flush=True)
    for n in args.nodes:
        print(json.dumps(one_size(n, args.keepalive)), flush=True)


if __name__ == "__main__":
    main()
