"""A rank for the reserve tests: 3 ranks, at most 2 active (MaxActiveWorldSize after
ShiftRanks), or with --tree 4 ranks in NVLink-like pairs under a job of at most 3 active
(rank_assignment.Tree, RESERVE at both layers, the pair's key a function of the rank); slot 1
dies in round 0 and the reserve (the last slot) takes its place in round 1.
Each call of the function records the RANK and WORLD_SIZE it was given in --out."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from ftd_client import inprocess
from ftd_client.inprocess import rank_assignment

SLOT = int(os.environ["RANK"])
parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--tree", action="store_true")
args = parser.parse_args()

RESERVE = rank_assignment.LayerFlag.RESERVE
ASSIGNMENT = (
    rank_assignment.Tree(
        [
            rank_assignment.Layer(min_ranks=1, max_ranks=3, key_or_fn="job", flag=RESERVE),
            rank_assignment.Layer(key_or_fn=lambda s: f"nvl{s.initial_rank // 2}", flag=RESERVE),
        ]
    )
    if args.tree
    else inprocess.Compose(rank_assignment.MaxActiveWorldSize(2), rank_assignment.ShiftRanks())
)


@inprocess.Wrapper(soft_timeout=30, hard_timeout=40, rank_assignment=ASSIGNMENT)
def train(call_wrapper: inprocess.CallWrapper | None = None) -> None:
    assert call_wrapper is not None
    rnd = call_wrapper.iteration
    record = {"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"call_i{rnd}_s{SLOT}.json").write_text(json.dumps(record))
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    if rnd == 0 and SLOT == 1:
        os._exit(5)  # after the allreduce: its peer is not left waiting in a collective
    dist.barrier()
    dist.destroy_process_group()
    (args.out / f"final_s{SLOT}.json").write_text(json.dumps({**record, "sum": total.item()}))


train()
(args.out / f"returned_s{SLOT}.json").write_text("{}")
