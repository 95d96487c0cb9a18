"""A rank for the in-process restart tests: a tiny model trained with allreduced gradients
under ftd_client.inprocess.Wrapper, with one fault injected on request.

State that must survive an in-process restart (the parameters and the step) lives at module
level; each round starts by broadcasting it from the round's rank 0, so every member, a
respawned one included, goes on from the same state. Marker files in --out tell the test what
happened: fault_*, unblocked_*, round_*, final_*.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from ftd_client import inprocess

SLOT = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RESPAWNED = os.environ.get("FTD_TEST_RESPAWNED") == "1"

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--step-time", type=float, default=0.0, help="seconds of 'compute' a step")
parser.add_argument("--fault", default="none", choices=["none", "raise", "exit", "sleep", "gil"])
parser.add_argument("--fault-rank", type=int, default=2, help="initial rank that faults")
parser.add_argument("--fault-step", type=int, default=5)
parser.add_argument("--soft-timeout", type=float, default=60.0)
parser.add_argument("--hard-timeout", type=float, default=90.0)
parser.add_argument("--barrier-timeout", type=float, default=120.0)
args = parser.parse_args()

params = torch.zeros(8, dtype=torch.float64)
step = 0
faulted = False  # one fault per process, in the first attempt only


def mark(name: str, payload: object) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / f".{name}.tmp"
    tmp.write_text(json.dumps(payload))
    tmp.replace(args.out / name)


def inject(iteration: int) -> None:
    global faulted
    if args.fault == "none" or faulted or ATTEMPT > 0 or SLOT != args.fault_rank:
        return
    faulted = True
    mark(f"fault_s{SLOT}", {"time": time.time(), "kind": args.fault, "iteration": iteration})
    print(f"injecting {args.fault} on rank {SLOT} at step {step}", flush=True)
    if args.fault == "raise":
        raise RuntimeError(f"injected failure on rank {SLOT} at step {step}")
    if args.fault == "exit":
        os._exit(3)
    if args.fault == "sleep":
        time.sleep(3600)
    if args.fault == "gil":  # a C call that keeps the GIL: nothing in this process can run
        ctypes.PyDLL(None).sleep(3600)


@inprocess.Wrapper(
    soft_timeout=args.soft_timeout,
    hard_timeout=args.hard_timeout,
    barrier_timeout=args.barrier_timeout,
    progress_watchdog_interval=0.2,
)
def train(call_wrapper: inprocess.CallWrapper | None = None) -> None:
    global params, step
    assert call_wrapper is not None
    iteration = call_wrapper.iteration
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = torch.cat([params, torch.tensor([float(step)], dtype=torch.float64)])
    dist.broadcast(state, src=0)
    params, step = state[:-1].clone(), int(state[-1].item())
    mark(
        f"round_i{iteration}_s{SLOT}",
        {"pid": os.getpid(), "rank": rank, "world": world, "step": step, "time": time.time()},
    )
    print(
        f"round {iteration}: rank {rank}/{world} initial {SLOT} pid {os.getpid()} step {step}",
        flush=True,
    )
    while step < args.steps:
        if step == args.fault_step:
            inject(iteration)
        if args.step_time:
            time.sleep(args.step_time)
        grad = torch.sin(torch.arange(8, dtype=torch.float64) + step * 0.1 + SLOT)
        try:
            dist.all_reduce(grad)
        except BaseException as error:
            mark(
                f"unblocked_i{iteration}_s{SLOT}",
                {"time": time.time(), "error": type(error).__name__, "step": step},
            )
            raise
        params -= 0.1 * grad / world
        step += 1
    dist.barrier()
    mark(
        f"final_s{SLOT}",
        {
            "params": params.tolist(),
            "step": step,
            "pid": os.getpid(),
            "iteration": iteration,
            "world": world,
            "attempt": ATTEMPT,
        },
    )
    print(f"finished: rank {rank}/{world} initial {SLOT} iteration {iteration}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    train()
    sys.exit(0)
