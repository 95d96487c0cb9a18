"""One rank of a 2-rank gloo DDP job that observes its own progress (ftd_client.progress) and
prints every record as a JSON line; rank 1 stops for good before step --stop-at, so rank 0
blocks in the next collective: DDP's allreduce in backward (--blocked-in ddp) or a Python
all_reduce (--blocked-in python).

    progress_rank.py RANK --init-file PATH --stop-at N --blocked-in ddp|python
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from datetime import timedelta

from ftd_client import progress


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rank", type=int)
    parser.add_argument("--init-file", required=True)
    parser.add_argument("--stop-at", type=int, default=5)
    parser.add_argument("--blocked-in", choices=("ddp", "python"), default="ddp")
    args = parser.parse_args()
    lock = threading.Lock()

    def send(record: progress.Progress) -> None:
        with lock:
            print(json.dumps({"rank": args.rank, **record.message().wire()}), flush=True)

    progress.install(send, interval_s=0.05, keepalive_s=0.1)
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{args.init_file}",
        rank=args.rank,
        world_size=2,
        timeout=timedelta(seconds=120),
    )
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(args.stop_at + 1):
        if step == args.stop_at:
            if args.rank == 1:
                threading.Event().wait()  # stopped: enters no collective ever again
            if args.blocked_in == "python":
                dist.all_reduce(torch.ones(1))
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    sys.exit("rank 0 was not blocked")


if __name__ == "__main__":
    main()
