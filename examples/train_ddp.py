"""A small real training job: DDP over gloo on CPU, periodic checkpoints, resume from the newest.

Runs unchanged under `torchrun` and `ftd serve` (where ftd_client's heartbeats and sections
are live; elsewhere they are no-ops). `--crash-at-step N` makes `--crash-rank` raise at step N
on the first attempt only, so a supervisor's restart and the resume from the newest checkpoint
can be seen; `--hang-at-step N` makes it hang there instead, for the hang detector to catch.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from ftd_client import RankClient
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ckpt-dir", default="runs/train_ddp_ckpt")
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--crash-at-step", type=int, default=-1)
    parser.add_argument("--crash-rank", type=int, default=1)
    parser.add_argument("--hang-at-step", type=int, default=-1)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument("--lr", type=float, default=0.05)
    return parser.parse_args()


def make_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(32, 16, generator=generator)
    y = x @ torch.linspace(-1, 1, 16).unsqueeze(1) + 0.1 * torch.randn(32, 1, generator=generator)
    return x, y


def newest_checkpoint(ckpt_dir: Path) -> Path | None:
    checkpoints = sorted(ckpt_dir.glob("step_*.pt"))
    return checkpoints[-1] if checkpoints else None


@record
def main() -> None:
    args = parse_args()
    ft = RankClient()
    ft.start_section("setup")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)

    start_step = 0
    checkpoint = newest_checkpoint(ckpt_dir)
    if checkpoint is not None:
        state = torch.load(checkpoint, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_step = state["step"]
        if rank == 0:
            print(f"[attempt {attempt}] resumed from {checkpoint.name} at step {start_step}")
    elif rank == 0:
        print(f"[attempt {attempt}] starting from scratch, world size {world}")

    ft.end_section("setup")
    loss = torch.tensor(0.0)
    for step in range(start_step, args.steps):
        ft.heartbeat()
        if attempt == 0 and rank == args.crash_rank:
            if step == args.crash_at_step:
                raise RuntimeError(f"injected fault: rank {rank} crashed at step {step}")
            if step == args.hang_at_step:
                stop = f"rank {rank} at step {step} (at {time.time():.6f})"
                print(f"[attempt {attempt}] injected hang: {stop}", flush=True)
                time.sleep(3600)
        with ft.section("step"):
            x, y = make_batch(step, rank)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            if args.step_time:
                time.sleep(args.step_time)
        done = step + 1
        if done % args.ckpt_every == 0 or done == args.steps:
            ft.start_section("checkpointing")
            if rank == 0:
                tmp = ckpt_dir / f".step_{done:08d}.pt.tmp"
                state = {
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": done,
                }
                torch.save(state, tmp)
                tmp.replace(ckpt_dir / f"step_{done:08d}.pt")
                print(f"[attempt {attempt}] step {done} loss {loss.item():.4f} (checkpoint saved)")
            dist.barrier()
            ft.end_section("checkpointing")
    if rank == 0:
        print(f"[attempt {attempt}] finished {args.steps} steps, final loss {loss.item():.4f}")
    # DDP before its group: with torch 2.13 a DDP that outlives the group can hang the exit
    # (docs/troubleshooting.md).
    del model, optimizer
    dist.destroy_process_group()
    ft.close()


if __name__ == "__main__":
    main()
