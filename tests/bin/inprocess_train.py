"""A rank for the in-process restart tests: a tiny model trained with allreduced gradients
under ftd_client.inprocess.Wrapper, with one fault injected on request.

State that must survive an in-process restart (the parameters and the step) lives at module
level; each round starts by broadcasting it from the round's rank 0, so every member, a
respawned one included, goes on from the same state. Marker files in --out tell the test what
happened: fault_*, aborted_* (written by the Wrapper's finalize, once the abort has unblocked the
rank), round_*, final_*.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

if "--nvrx-import" in sys.argv:  # NVRx's own API, unmodified: ftd's under --restart-mode inprocess
    from nvidia_resiliency_ext import inprocess  # type: ignore[import-not-found,no-redef]
else:
    from ftd_client import inprocess

SLOT = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RESPAWNED = "FTD_INPROCESS_RESPAWN" in os.environ

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--step-time", type=float, default=0.0, help="seconds of 'compute' a step")
INJECTIONS = ["none", "raise", "exit", "sleep", "gil", "late", "protected"]
parser.add_argument("--inject", default="none", choices=INJECTIONS)
parser.add_argument("--inject-rank", type=int, default=2, help="initial rank that faults")
parser.add_argument("--inject-step", type=int, default=5)
parser.add_argument("--soft-timeout", type=float, default=60.0)
parser.add_argument("--hard-timeout", type=float, default=90.0)
parser.add_argument("--barrier-timeout", type=float, default=120.0)
parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
parser.add_argument("--fr-path", default=None, help="AbortTorchDistributed's torch_fr_trace_path")
parser.add_argument("--nvrx-import", action="store_true", help="inprocess is NVRx's (see above)")
args = parser.parse_args()

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
params = torch.zeros(8, dtype=torch.float64)
faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks on demand, for debugging
step = 0
faulted = False  # one fault per process, in the first attempt only


def mark(name: str, payload: object) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / f".{name}.tmp"
    tmp.write_text(json.dumps(payload))
    tmp.replace(args.out / name)


def inject(iteration: int, late: bool = False) -> None:
    global faulted
    if args.inject == "none" or faulted or ATTEMPT > 0 or RESPAWNED or args.inject_rank != SLOT:
        return
    if late != (args.inject == "late"):
        return
    faulted = True
    mark(f"fault_s{SLOT}", {"time": time.time(), "kind": args.inject, "iteration": iteration})
    print(f"injecting {args.inject} on rank {SLOT} at step {step}", flush=True)
    if args.inject == "raise":
        raise RuntimeError(f"injected failure on rank {SLOT} at step {step}")
    if args.inject == "exit":
        os._exit(3)
    if args.inject == "sleep":
        time.sleep(3600)
    if args.inject == "gil":  # a C call that keeps the GIL: nothing in this process can run
        ctypes.PyDLL(None).sleep(3600)
    if args.inject == "late":  # once every other member's function has returned
        await_returned(iteration, dist.get_world_size() - 1)
        raise RuntimeError(f"injected late failure on rank {SLOT} after the others returned")


def await_returned(iteration: int, count: int) -> None:
    """Until `count` members' functions returned from this round (the Wrapper's done counter)."""
    from ftd_client.inprocess.keys import ENV_PREFIX, ENV_STORE_ADDR, Keys

    host, port = os.environ[ENV_STORE_ADDR].rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False)
    key = Keys(os.environ[ENV_PREFIX]).done(iteration)
    while store.add(key, 0) < count:  # a counter cannot be waited for: polled
        time.sleep(0.01)


def aborted(state: inprocess.FrozenState) -> None:
    assert state.fault is not None
    mark(
        f"aborted_i{state.iteration}_s{SLOT}",
        {"time": time.time(), "fault": state.fault.kind, "fault_rank": state.fault.rank},
    )


@inprocess.Wrapper(
    abort=inprocess.Compose(inprocess.abort.AbortTorchDistributed(args.fr_path)),
    finalize=aborted,
    soft_timeout=args.soft_timeout,
    hard_timeout=args.hard_timeout,
    barrier_timeout=args.barrier_timeout,
    progress_watchdog_interval=0.2,
)
def train(call_wrapper: inprocess.CallWrapper | None = None) -> None:
    global params, step
    assert call_wrapper is not None
    iteration = call_wrapper.iteration
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    state = torch.cat([params, torch.tensor([float(step)], dtype=torch.float64)]).to(device)
    dist.broadcast(state, src=0)
    params, step = state[:-1].cpu(), int(state[-1].item())
    mark(
        f"round_i{iteration}_s{SLOT}",
        {"pid": os.getpid(), "rank": rank, "world": world, "step": step, "time": time.time()},
    )
    print(
        f"round {iteration}: rank {rank}/{world} initial {SLOT} pid {os.getpid()} step {step}",
        flush=True,
    )
    while step < args.steps:
        if step == args.inject_step:
            inject(iteration)
            if args.inject == "protected" and ATTEMPT == 0 and iteration == 0:
                with call_wrapper.disable_hang_protection():  # a long load, on every rank
                    time.sleep(2 * args.soft_timeout)
        if args.step_time:
            time.sleep(args.step_time)
        grad = torch.sin(torch.arange(8, dtype=torch.float64) + step * 0.1 + rank).to(device)
        dist.all_reduce(grad)
        params -= 0.1 * grad.cpu() / world
        step += 1
    dist.barrier()
    inject(iteration, late=True)
    mark(
        f"final_s{SLOT}",
        {
            "params": params.tolist(),
            "step": step,
            "pid": os.getpid(),
            "iteration": iteration,
            "world": world,
            "attempt": ATTEMPT,
            "respawned": RESPAWNED,
        },
    )
    print(f"finished: rank {rank}/{world} initial {SLOT} iteration {iteration}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    train()
    sys.exit(0)
