"""A rank of a multi-node gloo job started by ftd (env:// init through the workers' store) that
makes optimizer steps, each with an all_reduce of its gradients. In the first attempt, global
rank --stuck-rank stops for good before step --stop-at: it enters no collective again, and the
other ranks block in the all_reduce it never enters. Later attempts step until stopped.

    job_hang_rank.py --stuck-rank R [--stop-at N] [--step-time S]
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stuck-rank", type=int, required=True)
    parser.add_argument("--stop-at", type=int, default=20)
    parser.add_argument("--step-time", type=float, default=0.05)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    print(f"job_hang_rank: ready a{attempt} r{rank}", flush=True)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    while True:
        if attempt == 0 and rank == args.stuck_rank and step == args.stop_at:
            print(f"job_hang_rank: rank {rank} stuck at step {step}", flush=True)
            threading.Event().wait()  # no collective, ever again
        optimizer.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        for parameter in model.parameters():
            assert parameter.grad is not None
            dist.all_reduce(parameter.grad)
        optimizer.step()
        step += 1
        time.sleep(args.step_time)


if __name__ == "__main__":
    main()
