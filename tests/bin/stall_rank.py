"""A rank whose hang builds up: optimizer steps --step-time apart (ftd's progress observer sees
them without the script's help) until the file --stop-file names exists, then none ever again.

    stall_rank.py --stop-file PATH [--step-time S]
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stop-file", type=Path, required=True)
    parser.add_argument("--step-time", type=float, default=0.05)
    args = parser.parse_args()
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    while not args.stop_file.exists():
        optimizer.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        step += 1
        if step == 1:
            print("stall_rank: stepping", flush=True)
        time.sleep(args.step_time)
    print(f"stall_rank: stalled at step {step}", flush=True)
    threading.Event().wait()  # no progress, ever


if __name__ == "__main__":
    main()
