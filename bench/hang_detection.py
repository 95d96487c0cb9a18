"""How late a silent rank is detected, killed, and its group back at work.

    python bench/hang_detection.py [--repeats 7] [--timeout 0.5]

Each repetition is one `ftd serve --nproc-per-node 2 --max-restarts 1
--ft-param-rank_heartbeat_timeout=T` run of this script. Attempt 0: both ranks join a gloo
group, do one allreduce, then heartbeat every 10 ms; after 1 s rank 1 goes silent and writes
the wall time of its last heartbeat (taken right after the send). Attempt 1: both ranks import
torch, join a new gloo group, do one allreduce and write the time it finished.

With t0 = last heartbeat + T (the earliest moment a verdict is due), per repetition:

* verdict: the `rank_hung` event's time - t0 (the event is written after the stack dump), and
  the daemon's own "overdue by" figure from the verdict's reason (its monotonic clock, from the
  receipt of the last heartbeat, before the stack dump);
* kill: the silent rank's `rank_exited` `ended_at` (the daemon reaped it) - t0;
* back at work: the last attempt-1 rank to finish its first allreduce - t0, with the steps
  between (workers_stopped, attempt_started, interpreter up, torch imported, group joined).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

import benchlib

STARTED = time.time()
INTERVAL_S = 0.01
SILENT_AFTER_S = 1.0
BAD_RANK = 1
FLOOR_ENV = "FTD_BENCH_FLOOR"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--timeout", type=float, default=0.5, help="rank_heartbeat_timeout (s)")
    parser.add_argument("--work-dir", default="/tmp/ftd-bench/hang_detection")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if os.environ.get(FLOOR_ENV):
        recover(Path(args.work_dir), int(os.environ["RANK"]), linger=True)
    elif benchlib.under_ftd():
        rank_main(Path(args.work_dir))
    else:
        launch(args)


# -- the rank ----------------------------------------------------------------------------------


def rank_main(work: Path) -> None:
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0:
        misbehave(work, rank)
    else:
        recover(work, rank)


def misbehave(work: Path, rank: int) -> None:
    import torch
    import torch.distributed as dist
    from ftd_client import RankClient

    client = RankClient()
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    silent_at = time.monotonic() + SILENT_AFTER_S
    next_beat = time.monotonic()
    while True:
        client.heartbeat()
        sent = time.time()
        if rank == BAD_RANK and time.monotonic() >= silent_at:
            benchlib.write_atomic(work / "last_heartbeat", repr(sent))
            time.sleep(3600)
        next_beat += INTERVAL_S
        time.sleep(max(0.0, next_beat - time.monotonic()))


def recover(work: Path, rank: int, linger: bool = False) -> None:
    marks = {"interpreter_up": STARTED}
    import torch
    import torch.distributed as dist

    marks["torch_imported"] = time.time()
    dist.init_process_group("gloo")
    marks["group_joined"] = time.time()
    dist.all_reduce(torch.ones(1))
    marks["allreduce_done"] = time.time()
    if linger:  # the floor: stay in the group, as attempt 0's ranks do, until killed
        benchlib.write_atomic(work / f"floor_{rank}.json", json.dumps(marks))
        time.sleep(3600)
    dist.destroy_process_group()
    benchlib.write_atomic(work / f"recovered_{rank}.json", json.dumps(marks))


# -- the launcher ------------------------------------------------------------------------------


def launch(args: argparse.Namespace) -> None:
    root = benchlib.fresh_dir(Path(args.work_dir))
    info = benchlib.machine()
    runs = []
    for repeat in range(args.repeats):
        work = benchlib.fresh_dir(root / f"r{repeat}")
        daemon = benchlib.serve(
            work, "hang", Path(__file__).resolve(), ["--work-dir", str(work)],
            "--nproc-per-node", "2", "--max-restarts", "1",
            f"--ft-param-rank_heartbeat_timeout={args.timeout}",
        )  # fmt: skip
        code = daemon.wait(timeout=300)
        if code != 0:
            raise SystemExit(f"repeat {repeat}: ftd serve exited {code}; see {work}")
        run = measure(work, args.timeout)
        run.update(floor(work))
        runs.append(run)
        print(f"repeat {repeat}: " + ", ".join(f"{k} {v:.1f}" for k, v in run.items()), flush=True)
    results = {"timeout_s": args.timeout, "runs": runs, "machine": info}
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def measure(work: Path, timeout: float) -> dict[str, float]:
    """Milliseconds after t0 = last heartbeat + timeout for each step of one repetition."""
    events = benchlib.events(work / "hang")
    t0 = float((work / "last_heartbeat").read_text()) + timeout
    [hung] = [e for e in events if e["kind"] == "rank_hung"]
    overdue = re.search(r"overdue by ([0-9.]+) ms", hung["data"]["reason"])
    assert overdue is not None, hung
    [exited] = [
        e for e in events if e["kind"] == "rank_exited" and e["data"]["pid"] == hung["data"]["pid"]
    ]
    stopped = min(e["time"] for e in events if e["kind"] == "workers_stopped")
    [started] = [e for e in events if e["kind"] == "attempt_started" and e["data"]["attempt"] == 1]
    marks = [json.loads((work / f"recovered_{r}.json").read_text()) for r in (0, 1)]

    def ms(t: float) -> float:
        return 1000 * (t - t0)

    return {
        "verdict (daemon's 'overdue by')": float(overdue.group(1)),
        "rank_hung event": ms(hung["time"]),
        "silent rank reaped": ms(exited["data"]["ended_at"]),
        "workers_stopped": ms(stopped),
        "attempt 1 started": ms(started["time"]),
        "attempt 1 interpreters up": ms(max(m["interpreter_up"] for m in marks)),
        "attempt 1 torch imported": ms(max(m["torch_imported"] for m in marks)),
        "attempt 1 gloo group joined": ms(max(m["group_joined"] for m in marks)),
        "attempt 1 first allreduce done": ms(max(m["allreduce_done"] for m in marks)),
    }


def floor(work: Path) -> dict[str, float]:
    """Without ftd, in the same repetition: two plain processes started at once doing what
    attempt 1 does (the cost of any restart), then one SIGKILLed and reaped (the cost of any
    kill of a rank holding torch and a gloo group)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = {**benchlib.child_env(), FLOOR_ENV: "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}  # fmt: skip
    spawned = time.time()
    procs = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--work-dir", str(work)],
            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
        )
        for rank in (0, 1)
    ]
    try:
        marks = [json.loads(benchlib.wait_for(work / f"floor_{r}.json", 120)) for r in (0, 1)]
        killed = time.time()
        procs[1].kill()
        procs[1].wait()
        reaped = time.time()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return {
        "floor: plain start to first allreduce": 1000
        * (max(m["allreduce_done"] for m in marks) - spawned),
        "floor: SIGKILL to reaped": 1000 * (reaped - killed),
    }


def report(results: dict[str, Any]) -> None:
    benchlib.print_machine(results["machine"])
    runs = results["runs"]
    print(
        f"# {len(runs)} repetitions, rank_heartbeat_timeout={results['timeout_s']}s, heartbeats "
        f"every {1000 * INTERVAL_S:.0f} ms; ms after last heartbeat + timeout"
    )
    print(f"{'step':<36} {'median':>9} {'min':>9} {'max':>9}")
    for key in runs[0]:
        if key == next(k for k in runs[0] if k.startswith("floor:")):
            print("# durations without ftd, measured in the same repetitions (ms):")
        values = [run[key] for run in runs]
        print(
            f"{key:<36} {statistics.median(values):>9.1f} {min(values):>9.1f} {max(values):>9.1f}"
        )


if __name__ == "__main__":
    main()
