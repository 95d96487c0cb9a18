"""A rank for the DDP in-process restart test: DistributedDataParallel over gloo under
ftd_client.inprocess.Wrapper, with one fault injected in each of the first --faults rounds.

In round r < --faults, initial rank r % WORLD_SIZE raises at a step drawn from round r's own
seed, while its peers are inside DDP's backward allreduce (or about to enter it): the case
where a process group is torn down with gloo work in flight. Each round writes a marker file
into --out; the last one writes final_s<rank>.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from ftd_client import inprocess

SLOT = int(os.environ.get("RANK", "0"))

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--faults", type=int, default=20)
parser.add_argument("--steps", type=int, default=10, help="steps of the round that completes")
parser.add_argument("--size", type=int, default=32)
parser.add_argument(
    "--nvrx-api",
    action="store_true",
    help="pass NVRx's Wrapper arguments (store_kwargs, health checks, initialize) and save a "
    "checkpoint inside call_wrapper.atomic() every step",
)
args = parser.parse_args()
NVRX_ARGS = (
    {
        "store_kwargs": {"port": int(os.environ.get("MASTER_PORT", "29500")) + 1},
        "health_check": inprocess.Compose(
            inprocess.health_check.CudaHealthCheck(),  # a no-op on CPU
            inprocess.health_check.FaultCounter(max_rank_faults=args.faults),
        ),
        "initialize": inprocess.initialize.RetryController(max_iterations=args.faults + 1),
        "finalize": inprocess.finalize.ThreadedFinalize(
            timeout=timedelta(seconds=10), fn=lambda: None
        ),
        "heartbeat_timeout": timedelta(seconds=30),
        "completion_timeout": timedelta(seconds=120),
    }
    if args.nvrx_api
    else {}
)


def mark(name: str, payload: object) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / f".{name}.tmp"
    tmp.write_text(json.dumps(payload))
    tmp.replace(args.out / name)


@inprocess.Wrapper(soft_timeout=30, hard_timeout=40, **NVRX_ARGS)
def train(call_wrapper: inprocess.CallWrapper | None = None) -> None:
    assert call_wrapper is not None
    rnd = call_wrapper.iteration
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.size, args.size) for _ in range(3)])
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    faulty = rnd % world if rnd < args.faults else None
    fault_step = random.Random(rnd).randint(1, 4)
    mark(f"round_i{rnd}_s{SLOT}", {"pid": os.getpid(), "time": time.time()})
    for step in range(args.steps if faulty is None else 1000):
        if faulty == SLOT and step == fault_step:
            raise RuntimeError(f"injected fault in round {rnd} on rank {SLOT} at step {step}")
        loss = ddp(torch.rand(8, args.size)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.nvrx_api:
            with call_wrapper.atomic():  # never interrupted half-written
                torch.save(model.state_dict(), args.out / f"ckpt_s{SLOT}.pt")
    params = [round(float(p.detach().sum()), 6) for p in model.parameters()]
    # DDP's Reducer before its group (docs/inprocess.md): with torch 2.13 a Reducer that
    # outlives the group's Python object destroys the gloo group with the GIL held.
    del ddp, opt
    dist.destroy_process_group()
    mark(f"final_s{SLOT}", {"pid": os.getpid(), "iteration": rnd, "params": params})


train()
