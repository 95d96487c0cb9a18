"""Training with ftd's hooks: setup, warmup, step sections, periodic checkpoints, eval.

The hooks are ftd_client.training's (Megatron-Bridge's semantics); under plain python or
torchrun they are no-ops. Run under ftd with a simulated fault, e.g.:

    ftd serve --nproc-per-node 2 --max-restarts 2 \\
        --ft-param-rank_section_timeouts=setup:60,step:5,checkpointing:30 \\
        --ft-param-rank_out_of_section_timeout=30 \\
        --ft-param-simulated_fault=hang:1:3 examples/train_sections.py
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from ftd_client import training
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ckpt-dir", default="runs/train_sections_ckpt")
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--data-time", type=float, default=0.02, help="out of any section")
    parser.add_argument("--calc-timeouts", action="store_true")
    return parser.parse_args()


@record
def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    hooks = training.setup(num_warmup_iters=1, calc_timeouts=args.calc_timeouts)
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    start = 0
    checkpoints = sorted(ckpt_dir.glob("step_*.pt"))
    if checkpoints:
        state = torch.load(checkpoints[-1], weights_only=True)
        model.module.load_state_dict(state["model"])
        start = state["step"]
        training.on_checkpoint_loaded(is_local_checkpoint=False)
        if rank == 0:
            print(f"[attempt {attempt}] resumed from {checkpoints[-1].name}", flush=True)
    for step in range(start, args.steps):
        time.sleep(args.data_time)  # "loading data": out-of-section time
        training.on_training_step_start()
        x = torch.randn(16, 8)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(args.step_time)
        training.on_training_step_end()
        done = step + 1
        if done % args.eval_every == 0:
            training.on_eval_step_start()
            with torch.no_grad():
                model(torch.randn(16, 8))
            training.on_eval_step_end()
        if done % args.ckpt_every == 0:
            training.on_checkpointing_start()
            if rank == 0:
                tmp = ckpt_dir / f".step_{done:06d}.tmp"
                torch.save({"model": model.module.state_dict(), "step": done}, tmp)
                tmp.replace(ckpt_dir / f"step_{done:06d}.pt")
                print(f"[attempt {attempt}] checkpoint at step {done}", flush=True)
            dist.barrier()
            training.on_checkpointing_end(is_async_finalization=False)
    if rank == 0:
        print(f"[attempt {attempt}] finished, steps in section: {hooks.steps_in_section}")
    training.shutdown()
    # DDP before its group: with torch 2.13 a DDP that outlives the group can hang the exit
    # (docs/troubleshooting.md).
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
