"""A rank for the RoundManager test: a ManagedProcessGroup over the in-process Wrapper's rounds.

Every step allreduces (through the ManagedProcessGroup) a tensor holding this rank's initial
rank + 1. On the first round, rank `--fault-rank` faults at step 3: `sleep` (its peers'
allreduce times out in gloo, the ManagedProcessGroup swallows the error and reports it to the
manager, which ends the round) or `exit` (the process dies; the daemon ends the round).
Writes `<out>/final_s<initial rank>.json`: pid, attempt, round, size() and the last sum.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
from ftd_client import inprocess
from ftd_client.process_group import ManagedProcessGroup

SLOT = int(os.environ["RANK"])
parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--inject", choices=["sleep", "exit"], required=True)
parser.add_argument("--fault-rank", type=int, default=2)
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()


@inprocess.Wrapper(soft_timeout=60, hard_timeout=90)
def train(call_wrapper: inprocess.CallWrapper | None = None) -> dict[str, object]:
    assert call_wrapper is not None
    manager = inprocess.RoundManager(call_wrapper, timeout=timedelta(seconds=2))
    pg = ManagedProcessGroup(manager)
    total = torch.zeros(1)
    for step in range(args.steps):
        if call_wrapper.iteration == 0 and step == 3 and args.fault_rank == SLOT:
            if args.inject == "exit":
                os._exit(3)
            time.sleep(3600)  # interrupted when a peer's manager ends the round
        total = torch.full((1,), float(SLOT + 1))
        pg.allreduce([total]).wait()
    return {"size": pg.size(), "sum": total.item(), "iteration": call_wrapper.iteration}


result = train()
(args.out / f"final_s{SLOT}.json").write_text(
    json.dumps({**result, "pid": os.getpid(), "attempt": os.environ["TORCHELASTIC_RESTART_COUNT"]})
)
