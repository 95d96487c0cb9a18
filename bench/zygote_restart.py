"""Restart latency and clean start-up with `--start-method zygote` against the subprocess
start method (and torchrun), alternated in one run.

A job of `--nproc` gloo ranks on CPU: every rank joins the group, allreduces once and writes the
time; on attempt 0, rank 1 then writes the time and exits 1 (the others wait to be stopped); on
attempt 1 every rank allreduces once and exits 0. Measured per run:

- restart: from rank 1's crash to the last rank of attempt 1 done with its first allreduce;
- start-up: from launching the launcher to the last rank of attempt 0 done with its allreduce.

    PYTHONPATH=.:client python bench/zygote_restart.py --runs 5
    PYTHONPATH=.:client python bench/zygote_restart.py --methods zygote,subprocess,torchrun,floor

`floor` is no launcher: the issue's lower bound, measured the same way in the same run. A
process that has imported torch forks the ranks, and each joins a gloo group through a TCPStore
that another process already hosts and finishes an allreduce; its "restart" is from just before
the first fork to the last rank's allreduce, its "start-up" from launching it to the same point.

Every timestamp is wall-clock `time.time()` on this machine. The same file is the rank script
(`--as-rank OUT`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FAIL_RANK = 1


def rank(out: Path) -> None:
    import torch
    import torch.distributed as dist

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    me = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    (out / f"allreduce_a{attempt}_r{me}").write_text(repr(time.time()))
    dist.barrier()
    if attempt == 0:
        if me == FAIL_RANK:
            (out / "crash").write_text(repr(time.time()))
            os._exit(1)
        while True:
            time.sleep(3600)
    dist.destroy_process_group()


def floor(out: Path, nproc: int) -> None:
    """Fork `nproc` gloo ranks from this process, which has imported torch (the floor)."""
    import torch
    import torch.distributed as dist

    # The store lives in another process: forking while a TCPStore server thread runs deadlocks.
    store_host = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, torch.distributed as d\n"
            "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
            "print(s.port, flush=True)\n"
            "sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert store_host.stdout is not None
    port = int(store_host.stdout.readline())
    forked = time.time()
    children = []
    for me in range(nproc):
        pid = os.fork()
        if pid == 0:
            store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
            dist.init_process_group("gloo", store=store, rank=me, world_size=nproc)
            dist.all_reduce(torch.ones(1))
            (out / f"allreduce_a1_r{me}").write_text(repr(time.time()))
            os._exit(0)
        children.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    store_host.kill()
    store_host.wait()
    if any(codes):
        raise SystemExit(f"floor ranks exited {codes}")
    (out / "crash").write_text(repr(forked))
    for me in range(nproc):
        (out / f"allreduce_a0_r{me}").write_text((out / f"allreduce_a1_r{me}").read_text())


def command(method: str, nproc: int, out: Path, log_dir: Path) -> list[str]:
    script = [str(Path(__file__).resolve()), "--as-rank", str(out)]
    common = ["--nproc-per-node", str(nproc), "--max-restarts", "1"]
    if method == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", *common, *script]
    if method == "floor":
        return [sys.executable, str(Path(__file__).resolve()), "--as-floor", str(out), str(nproc)]
    return [
        sys.executable,
        "-m",
        "ftd",
        "serve",
        "--log-dir",
        str(log_dir),
        "--run-id",
        "bench",
        "--api-port",
        "off",
        "--start-method",
        method,
        *common,
        *script,
    ]


def one_run(method: str, nproc: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix=f"zygote_bench_{method}_") as tmp:
        out, log_dir = Path(tmp, "out"), Path(tmp, "logs")
        out.mkdir()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "client")])}
        # torchrun's shared store makes restarted gloo ranks fail (pytorch/pytorch#135712).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        launched = time.time()
        with open(Path(tmp, "launcher.log"), "wb") as launcher_log:
            code = subprocess.run(
                command(method, nproc, out, log_dir),
                stdout=launcher_log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                timeout=300,
                check=False,
            ).returncode
        if code != 0:
            raise RuntimeError(f"{method} exited {code}:\n{Path(tmp, 'launcher.log').read_text()}")

        def last(attempt: int) -> float:
            return max(
                float(out.joinpath(f"allreduce_a{attempt}_r{r}").read_text()) for r in range(nproc)
            )

        crash = float(out.joinpath("crash").read_text())
        return {"startup_s": last(0) - launched, "restart_s": last(1) - crash}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--as-rank", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--as-floor", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=5, help="runs per method")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--methods", default="zygote,subprocess,torchrun,floor")
    parser.add_argument("--json", type=Path, help="write every run here")
    args = parser.parse_args()
    if args.as_rank is not None:
        rank(args.as_rank)
        return
    if args.as_floor is not None:
        floor(Path(args.as_floor[0]), int(args.as_floor[1]))
        return
    methods = args.methods.split(",")
    results: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    for index in range(args.runs):
        order = methods if index % 2 == 0 else methods[::-1]
        for method in order:
            result = one_run(method, args.nproc)
            results[method].append(result)
            print(
                f"run {index} {method:10s} restart {result['restart_s'] * 1000:7.0f} ms"
                f"   start-up {result['startup_s']:6.2f} s",
                flush=True,
            )
    print(
        f"\n{platform.node()}, {os.cpu_count()} CPUs, {platform.python_version()}, "
        f"{args.nproc} ranks, {args.runs} runs per method"
    )
    print(f"{'method':12s} {'restart median':>16s} {'(min-max)':>18s} {'start-up median':>16s}")
    for method, runs in results.items():
        restarts = [r["restart_s"] * 1000 for r in runs]
        startups = [r["startup_s"] for r in runs]
        print(
            f"{method:12s} {statistics.median(restarts):13.0f} ms "
            f"{min(restarts):8.0f}-{max(restarts):.0f} ms {statistics.median(startups):14.2f} s"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
