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
args = parser.parse_args()


def mark(name: str, payload: object) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / f".{name}.tmp"
    tmp.write_text(json.dumps(payload))
    tmp.replace(args.out / name)


@inprocess.Wrapper(soft_timeout=30, hard_timeout=40)
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
    params = [round(float(p.detach().sum()), 6) for p in model.parameters()]
    # DDP's Reducer before its group (docs/inprocess.md): with torch 2.13 a Reducer that
    # outlives the group's Python object destroys the gloo group with the GIL held.
    del ddp, opt
    dist.destroy_process_group()
    mark(f"final_s{SLOT}", {"pid": os.getpid(), "iteration": rnd, "params": params})


train()
