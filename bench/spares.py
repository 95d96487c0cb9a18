"""A node lost, and the job running again: with a hot spare, and without one.

    PYTHONPATH=.:client python bench/spares.py [--repeats 3]

Each run is one job of two nodes of one rank each on this machine (c10d rendezvous hosted by
node a, a job secret, the rank script tests/bin/worker.py, torch-free). Node b's daemon is
SIGKILLed while the first attempt runs; measured is the time from the kill to the rank of the
next attempt on the node that replaces b being ready (its marker file), in three setups:

* `spare`: `--nnodes 2` and a third node c started beforehand, which waits as a standby (the
  round was full) and takes b's place;
* `shrink`: `--nnodes 1:2`, no spare: node a goes on alone (the world size halves);
* `replacement`: `--nnodes 2`, no spare: a new daemon for b is started at the kill, as a
  scheduler would restart the node (its start-up counts).

Medians and maxima of --repeats runs, every setup in each repetition, in ms.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import benchlib

WORKER = benchlib.ROOT / "tests" / "bin" / "worker.py"
SECRET = "bench-spares-secret"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def node(work: Path, node_id: str, nnodes: str, endpoint: str) -> subprocess.Popen[bytes]:
    out = work / "out" / node_id
    out.mkdir(parents=True, exist_ok=True)
    flags = (
        "--node-id", node_id, "--nnodes", nnodes, "--rdzv-backend", "c10d",
        "--rdzv-endpoint", endpoint, "--local-addr", "127.0.0.1",
        "--node-keepalive-timeout", "2", "--rdzv-last-call-timeout", "10",
        "--shutdown-timeout", "2", "--max-restarts", "3", "--preload", "none",
    )  # fmt: skip
    cmd = [
        sys.executable, "-m", "ftd", "serve", "--api-port", "off", "--log-dir", str(work),
        "--run-id", "job", *flags, str(WORKER), "--out", str(out), "--hang-attempts", "1",
    ]  # fmt: skip
    log = work / f"{node_id}.{len(list(work.glob(node_id + '.*.err')))}.err"
    env = {**benchlib.child_env(), "FTD_RDZV_SECRET": SECRET}
    return subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=log.open("wb"), stdin=subprocess.DEVNULL, env=env
    )


def await_file(path: Path, timeout_s: float) -> float:
    """The file's modification time (wall clock) once it exists."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return path.stat().st_mtime
        except FileNotFoundError:
            time.sleep(0.002)
    raise TimeoutError(f"{path} did not appear within {timeout_s:g}s")


def run(setup: str, work: Path) -> float:
    work = benchlib.fresh_dir(work)
    endpoint = f"127.0.0.1:{free_port()}"
    nnodes = "1:2" if setup == "shrink" else "2"
    procs = {"a": node(work, "a", nnodes, endpoint)}
    time.sleep(1.0)  # a hosts the store: first in the rendezvous, node rank 0
    procs["b"] = node(work, "b", nnodes, endpoint)
    try:
        await_file(work / "out" / "b" / "ready_a0_r1", 60)
        if setup == "spare":
            procs["c"] = node(work, "c", nnodes, endpoint)
            deadline = time.monotonic() + 60
            err = work / "c.0.err"
            while b"is full" not in (err.read_bytes() if err.exists() else b""):
                if time.monotonic() > deadline:
                    raise TimeoutError("the spare did not wait as a standby")
                time.sleep(0.01)
        killed = time.time()
        procs["b"].send_signal(signal.SIGKILL)
        if setup == "replacement":
            procs["b2"] = node(work, "b", nnodes, endpoint)
        taker = {"spare": "c", "shrink": "a", "replacement": "b"}[setup]
        rank = "r0" if setup == "shrink" else "r1"
        ready = await_file(work / "out" / taker / f"ready_a1_{rank}", 90)
        return (ready - killed) * 1000
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work-dir", default="/tmp/ftd-bench/spares")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    info = benchlib.machine()
    setups = ("spare", "shrink", "replacement")
    results: dict[str, list[float]] = {setup: [] for setup in setups}
    for repeat in range(args.repeats):
        order = setups if repeat % 2 == 0 else tuple(reversed(setups))
        for setup in order:
            ms = run(setup, Path(args.work_dir) / setup)
            results[setup].append(ms)
            print(f"repeat {repeat} {setup}: node b killed -> next rank ready {ms:.0f} ms")
    benchlib.print_machine(info)
    print("| setup | kill -> the job's next rank ready on b's replacement, median | max |")
    print("| --- | ---: | ---: |")
    for setup in setups:
        values = results[setup]
        print(f"| {setup} | {statistics.median(values):.0f} ms | {max(values):.0f} ms |")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "ms": results}, indent=1))
    sys.exit(0)


if __name__ == "__main__":
    main()
