"""What observing progress (ftd_client.progress) costs a training step and a collective.

    python bench/progress_overhead.py [--blocks 20] [--steps 300] [--calls 2000] [--out FILE]

One process, same run: blocks alternate without and with `progress.install` (the sampler
thread at its default 0.5 s, records encoded for the wire), so a busy machine's drift hits
both alike. Each pair's order is drawn at random (on this VM a block's position alone moves
its median by tens of us), and the overhead is the median of the paired differences (the
block with the hooks minus its pair's block without).

Steps: a 2-layer MLP (64-256-10, batch 32, SGD, cross-entropy, one intra-op thread), each
step timed alone, in wall time and in the main thread's CPU time (CLOCK_THREAD_CPUTIME_ID:
what the step itself burnt, blind to the other tenants' preemptions); each block reports its
median and max. Collectives: a one-rank gloo all_reduce of one element, per call, with and
without the wrapper that counts calls. Then the parts alone, best of repeats: the step hook,
the forward wrapper, the collective wrapper, and one sample of the sampler thread (the default
group's sequence number read, the record built).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "client")]

from ftd_client import progress, wire  # noqa: E402
from ftd_client._progress_torch import Counters, _counted  # noqa: E402


class Order:
    """Whether each block runs with the hooks: pairs of one each, in a random order."""

    def __init__(self, seed: int = 25) -> None:
        self.random = random.Random(seed)

    def pairs(self, count: int) -> list[bool]:
        order: list[bool] = []
        for _ in range(count):
            first = self.random.random() < 0.5
            order += [first, not first]
        return order


ORDER = Order()


def sink(record: progress.Progress) -> None:
    wire.encode(record.message(), sent_ns=record.sampled_ns)  # what a send pays before its syscall


def step_blocks(blocks: int, steps: int) -> list[dict[str, Any]]:
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss = torch.nn.CrossEntropyLoss()
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    clock = time.perf_counter_ns

    cpu = time.thread_time_ns

    def run(n: int) -> tuple[list[int], list[int]]:
        times, cpu_times = [], []
        for _ in range(n):
            started, started_cpu = clock(), cpu()
            optimizer.zero_grad()
            loss(model(x), y).backward()
            optimizer.step()
            cpu_times.append(cpu() - started_cpu)
            times.append(clock() - started)
        return times, cpu_times

    run(300)  # warm up
    results = []
    for observed in ORDER.pairs(blocks):
        if observed:
            progress.install(sink)
        times, cpu_times = run(steps)
        if observed:
            progress.uninstall()
        results.append(
            {
                "observed": observed,
                "median_us": statistics.median(times) / 1e3,
                "mean_us": statistics.fmean(times) / 1e3,
                "max_us": max(times) / 1e3,
                "cpu_median_us": statistics.median(cpu_times) / 1e3,
            }
        )
    return results


def collective_blocks(blocks: int, calls: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as directory:
        store = dist.FileStore(os.path.join(directory, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        tensor = torch.ones(1)
        clock = time.perf_counter_ns
        for _ in range(500):
            dist.all_reduce(tensor)
        rows = []
        for observed in ORDER.pairs(blocks):
            if observed:
                progress.install(sink)
            all_reduce = dist.all_reduce  # looked up as a script does: wrapped when observed
            times = []
            for _ in range(calls):
                started = clock()
                all_reduce(tensor)
                times.append(clock() - started)
            if observed:
                progress.uninstall()
            rows.append({"observed": observed, "median_us": statistics.median(times) / 1e3})
        observer = progress.Observer(sink)
        sample_us = min(timeit.repeat(observer.sample, number=1000, repeat=5)) * 1e3
        dist.destroy_process_group()
    return {"blocks": rows, "sampler_sample_us": sample_us}


def summary(rows: list[dict[str, Any]], key: str = "median_us") -> dict[str, float]:
    """Medians over the blocks, and of the paired differences (a block with the hooks minus
    the block just before it, without)."""
    off = [row[key] for row in rows if not row["observed"]]
    on = [row[key] for row in rows if row["observed"]]
    base = statistics.median(off)
    pairs = zip(rows[::2], rows[1::2], strict=True)
    paired = statistics.median(
        (a[key] - b[key]) if a["observed"] else (b[key] - a[key]) for a, b in pairs
    )
    return {
        "median_off_us": base,
        "median_on_us": statistics.median(on),
        "overhead_us": paired,
        "overhead_pct": 100 * paired / base,
    }


def parts() -> dict[str, float]:
    """Each hook alone, best of repeats (us per call)."""
    import torch
    from ftd_client._progress_torch import TorchHooks, _timed_forward

    counters = Counters()
    hooks = TorchHooks(counters)

    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    timed = _timed_forward(counters, noop, torch.is_grad_enabled)
    counted = _counted(counters, noop)

    def best(call: Any) -> float:
        return min(timeit.repeat(call, number=100_000, repeat=7)) * 10  # us per call

    bare = best(lambda: noop(None, 1))
    return {
        "step_hook_us": best(lambda: hooks._on_step(None, (), {})),
        "forward_wrapper_us": best(lambda: timed(None, 1)) - bare,
        "collective_wrapper_us": best(lambda: counted(None, 1)) - bare,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20, help="pairs of blocks (off, on)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per block")
    parser.add_argument("--calls", type=int, default=2000, help="all_reduce calls per block")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    steps = step_blocks(args.blocks, args.steps)
    collectives = collective_blocks(args.blocks, args.calls)
    result = {
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "python": platform.python_version(),
        "steps": {
            "blocks": steps,
            **summary(steps),
            "cpu": summary(steps, "cpu_median_us"),
        },
        "collectives": {**collectives, **summary(collectives["blocks"])},
        "parts": parts(),
    }
    for name in ("steps", "collectives"):
        print(f"== {name}")
        for row in result[name]["blocks"]:
            extra = (
                f" max {row['max_us']:8.1f} cpu {row['cpu_median_us']:8.2f}"
                if "max_us" in row
                else ""
            )
            label = "with   " if row["observed"] else "without"
            print(f"  {label} median {row['median_us']:8.2f} us{extra}")
        parts_ = [("wall", result[name])] + (
            [("cpu", result[name]["cpu"])] if name == "steps" else []
        )
        for label, part in parts_:
            print(
                f"  {label} overhead {part['overhead_us']:+.2f} us ({part['overhead_pct']:+.2f} %) "
                f"of {part['median_off_us']:.2f} us"
            )
    for name, value in result["parts"].items():
        print(f"{name} {value:.3f}")
    print(f"one sample {collectives['sampler_sample_us']:.2f} us")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
