"""A rank that says it is alive at once (a heartbeat), then loads for --load-s seconds before
its first optimizer step, as a restarted job's start-up does; in attempt 0 it makes steps until
--fail-file exists, then fails. The restart's recovery ends at its first step, not its first
heartbeat (ftd/health/service.py)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from ftd_client import RankClient


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-file", type=Path, required=True)
    parser.add_argument("--load-s", type=float, default=1.5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    client = RankClient()
    client.heartbeat()
    time.sleep(args.load_s)  # the start-up: the job is not back before its first step
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = 0
    while attempt == 0 or step < args.steps:
        if attempt == 0 and args.fail_file.exists():
            sys.exit(3)
        optimizer.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        client.heartbeat()
        step += 1
        time.sleep(0.05)


if __name__ == "__main__":
    main()
