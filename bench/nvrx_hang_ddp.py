"""tests/bin/plain_ddp.py's training loop instrumented for NVIDIA's ft_launcher: the same DDP
model, batches, checkpoints every --ckpt-every steps (rank 0, torch.save, then a barrier) and
resume from the newest, plus a heartbeat through NVRx's `RankMonitorClient` before every step
(what ft_launcher's hang detection needs). In the first attempt (TORCHELASTIC_RESTART_COUNT 0)
rank --stop-rank stops for good before step --stop-at-step and prints the wall time it stopped.
Used by bench/hang_blame.py."""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient  # type: ignore[import-untyped]
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(32, 16, generator=generator)
    return x, x.sum(dim=1, keepdim=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--step-time", type=float, default=0.02)
    parser.add_argument("--stop-at-step", type=int, default=-1)
    parser.add_argument("--stop-rank", type=int, default=1)
    args = parser.parse_args()
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    monitor = RankMonitorClient()
    monitor.init_workload_monitoring()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    start = 0
    checkpoints = sorted(ckpt_dir.glob("step_*.pt"))
    if checkpoints:
        state = torch.load(checkpoints[-1], weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        print(f"rank {rank}: resumed at step {start}", flush=True)
    for step in range(start, args.steps):
        monitor.send_heartbeat()
        if first_attempt and step == args.stop_at_step and rank == args.stop_rank:
            stop = f"stopping for good at step {step} (at {time.time():.6f})"  # wall time
            print(f"rank {rank}: {stop}", flush=True)
            threading.Event().wait()
        x, y = batch(step, rank)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        time.sleep(args.step_time)
        done = step + 1
        if done % args.ckpt_every == 0 or done == args.steps:
            if rank == 0:
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
                state["step"] = done
                tmp = ckpt_dir / f".step_{done:08d}.tmp"
                torch.save(state, tmp)
                tmp.replace(ckpt_dir / f"step_{done:08d}.pt")
            dist.barrier()
    print(f"rank {rank}: finished {args.steps} steps", flush=True)
    monitor.shutdown_workload_monitoring()
    del model, optimizer  # before their group: docs/troubleshooting.md
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
