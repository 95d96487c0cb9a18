"""A DDP job (gloo, any world size) that snapshots its whole state into the node's memory every
step with ftd_client.checkpoint and resumes from it: the memory tier's test job.

Deterministic: the model starts from one seed, step N's batch comes from a generator seeded by
(N, rank), so a run that resumed ends bit-identical to one that never failed. The state holds
the model, Adam's state, a BatchNorm's buffers (changed by every forward), a rank-specific
tensor and a Python counter.

  --steps N           steps in all
  --kill-at-step N    rank --kill-rank SIGKILLs itself in step N, then in step N+5 of a later
                      attempt, N+10 ..., --kill-attempts times in all (1), each once every
                      rank's snapshot of the step before is written (checkpoint.wait, a
                      barrier); <out>/killed-<k> counts them (an attempt ended by something
                      else, such as a lost node, kills nothing)
  --pause-at-step N   rank --kill-rank stops in step N of the first attempt that reaches it, once
                      every rank's snapshot of the step before is written (and its write to
                      --checkpoint-persist, if one was under way), and writes
                      <out>/paused; the others wait in a barrier (a test then kills its node)
  --width W           the model's hidden width (its state grows with W^2)
Writes <out>/final-<rank>.pt (the final state) and <out>/resumed-<attempt>-<rank> (the step
load returned, or "none").
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from ftd_client import checkpoint
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-at-step", type=int, default=0)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-attempts", type=int, default=1)
    parser.add_argument("--pause-at-step", type=int, default=0)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, args.width), nn.BatchNorm1d(args.width), nn.ReLU(), nn.Linear(args.width, 4)
    )
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    mine = torch.zeros(8)  # rank-specific: the sum of this rank's batches' first rows
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "mine": mine, "n": 0}
    resumed = checkpoint.load(state)
    if resumed is not None:
        optimizer.load_state_dict(state["optim"])
        mine = state["mine"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"resumed-{attempt}-{rank}").write_text(str(resumed) if resumed else "none")
    kills = len(list(args.out.glob("killed-*")))  # before any rank of this attempt kills
    for step in range((resumed or 0) + 1, args.steps + 1):
        generator = torch.Generator().manual_seed(step * 1000 + rank)
        batch = torch.randn(32, 16, generator=generator)
        target = torch.randn(32, 4, generator=generator)
        loss = nn.functional.mse_loss(ddp(batch), target)
        optimizer.zero_grad()
        loss.backward()
        if kills < args.kill_attempts and step == args.kill_at_step + 5 * kills:
            checkpoint.wait()
            dist.barrier()
            if rank == args.kill_rank:
                (args.out / f"killed-{kills}").touch()
                os.kill(os.getpid(), signal.SIGKILL)
            dist.barrier()  # the others wait here until the daemon stops them
        if step == args.pause_at_step and not (args.out / "paused").exists():
            checkpoint.wait(persisted=True)
            dist.barrier()
            if rank == args.kill_rank:
                (args.out / "paused").touch()
                while True:
                    time.sleep(1)
            dist.barrier()
        optimizer.step()
        mine.add_(batch[0, :8])
        state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "mine": mine,
                 "n": step}  # fmt: skip
        checkpoint.save(state, step)
    checkpoint.wait()
    torch.save(state, args.out / f"final-{rank}.pt")
    del ddp  # before its group: docs/troubleshooting.md
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
