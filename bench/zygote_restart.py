"""Restart latency and clean start-up with `--start-method zygote` against the subprocess
start method (and torchrun), alternated in one run.

A job of `--nproc` gloo ranks on CPU: every rank joins the group, allreduces once and writes the
time; on attempt 0, rank 1 then writes the time and exits 1 (the others wait to be stopped); on
attempt 1 every rank allreduces once and exits 0. Measured per run:

- restart: from rank 1's crash to the last rank of attempt 1 done with its first allreduce;
- start-up: from launching the launcher to the last rank of attempt 0 done with its allreduce.

    PYTHONPATH=.:client python bench/zygote_restart.py --runs 5
    PYTHONPATH=.:client python bench/zygote_restart.py --methods zygote,subprocess,torchrun

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


def command(method: str, nproc: int, out: Path, log_dir: Path) -> list[str]:
    script = [str(Path(__file__).resolve()), "--as-rank", str(out)]
    common = ["--nproc-per-node", str(nproc), "--max-restarts", "1"]
    if method == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", *common, *script]
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
    parser.add_argument("--runs", type=int, default=5, help="runs per method")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--methods", default="zygote,subprocess,torchrun")
    parser.add_argument("--json", type=Path, help="write every run here")
    args = parser.parse_args()
    if args.as_rank is not None:
        rank(args.as_rank)
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
