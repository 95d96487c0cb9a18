"""A DDP training script that knows nothing of ftd or NVRx (gloo, any world size): what a
torchrun user runs. It checkpoints every --ckpt-every steps (rank 0, torch.save) and resumes
from the newest checkpoint.

Faults and long phases, in the first attempt only (TORCHELASTIC_RESTART_COUNT 0):
  --stop-at-step N    rank --stop-rank stops for good before step N (enters nothing again)
  --crash-at-step N   rank --stop-rank exits with code 1 before step N
  --slow-save S       rank 0's first checkpoint takes S more seconds inside torch.save while
                      the others wait in the barrier after it
  --eval-seconds S    after the first checkpoint every rank evaluates for S seconds: no
                      optimizer step, an all_reduce every 100 ms
  --epochs E          the steps are split into E epochs, each iterating a new DataLoader with
                      2 workers (a new iterator at every epoch boundary)
  --slow-forward-rank R --slow-forward-ms MS
                      rank R's model forward sleeps MS more every step (a straggler: only its
                      forward time grows; DDP makes every rank's step time equal), every attempt
  --slow-data-rank R --slow-data-ms MS
                      rank R's batch takes MS more to get, every step, before the forward (a
                      slow data loader: neither its forward time nor, under DDP, its step time
                      differs; only its host time between steps does), every attempt

--pg-timeout S sets the gloo process group's timeout (torch's default: 30 min), how long a rank
blocked in a collective another rank never enters waits before it fails.
"""

from __future__ import annotations

import argparse
import datetime
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class SlowFile:
    """A file whose writes take `seconds` in all: a slow disk under torch.save."""

    def __init__(self, path: Path, seconds: float) -> None:
        self._file = path.open("wb")
        self._delay = seconds

    def write(self, data: Any) -> int:
        time.sleep(self._delay)  # the first write waits for the disk, inside torch.save
        self._delay = 0.0
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class SlowSequential(nn.Sequential):
    """nn.Sequential (the same state dict) whose forward first sleeps `delay_s`."""

    delay_s = 0.0

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)
        result: torch.Tensor = super().forward(input)
        return result


class Batches(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, first: int, count: int, rank: int) -> None:
        self.first, self.count, self.rank = first, count, rank

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed((self.first + index) * 1000 + self.rank)
        x = torch.randn(32, 16, generator=generator)
        return x, x.sum(dim=1, keepdim=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--step-time", type=float, default=0.02)
    parser.add_argument("--stop-at-step", type=int, default=-1)
    parser.add_argument("--crash-at-step", type=int, default=-1)
    parser.add_argument("--stop-rank", type=int, default=1)
    parser.add_argument("--slow-save", type=float, default=0.0)
    parser.add_argument("--eval-seconds", type=float, default=0.0)
    parser.add_argument("--epochs", type=int, default=0)
    parser.add_argument("--slow-forward-rank", type=int, default=-1)
    parser.add_argument("--slow-forward-ms", type=float, default=0.0)
    parser.add_argument("--slow-data-rank", type=int, default=-1)
    parser.add_argument("--slow-data-ms", type=float, default=0.0)
    parser.add_argument("--pg-timeout", type=float, default=None)
    args = parser.parse_args()
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    if args.pg_timeout is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = SlowSequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    if rank == args.slow_forward_rank:
        module.delay_s = args.slow_forward_ms / 1000
    model = DistributedDataParallel(module)
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

    epochs = max(args.epochs, 1)
    per_epoch = -(-(args.steps - start) // epochs) if args.steps > start else 0
    step, saved = start, False
    for _ in range(epochs):
        count = min(per_epoch, args.steps - step)
        if count <= 0:
            break
        if args.epochs:
            loader = torch.utils.data.DataLoader(
                Batches(step, count, rank), batch_size=None, num_workers=2
            )
            batches: Any = iter(loader)
        else:
            batches = (Batches(step, count, rank)[i] for i in range(count))
        if rank == args.slow_data_rank:
            batches = slowed(batches, args.slow_data_ms / 1000)
        for x, y in batches:
            if first_attempt and step == args.stop_at_step and rank == args.stop_rank:
                stop = f"stopping for good at step {step} (at {time.time():.6f})"  # wall time
                print(f"rank {rank}: {stop}", flush=True)
                threading.Event().wait()
            if first_attempt and step == args.crash_at_step and rank == args.stop_rank:
                raise SystemExit(f"rank {rank}: crashing at step {step}")
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            time.sleep(args.step_time)
            step += 1
            if step % args.ckpt_every == 0 or step == args.steps:
                slow = args.slow_save if first_attempt and not saved else 0.0
                save(model, optimizer, step, ckpt_dir, rank, slow)
                if first_attempt and not saved and args.eval_seconds:
                    evaluate(args.eval_seconds)
                saved = True
    print(f"rank {rank}: finished {step} steps", flush=True)
    del model, optimizer  # before their group: docs/troubleshooting.md
    dist.destroy_process_group()


def save(
    model: DistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    step: int,
    ckpt_dir: Path,
    rank: int,
    slow_s: float,
) -> None:
    if rank == 0:
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
        state["step"] = step
        tmp = ckpt_dir / f".step_{step:08d}.tmp"
        if slow_s:
            print(f"rank 0: a slow torch.save ({slow_s:g}s)", flush=True)
            out = SlowFile(tmp, slow_s)
            torch.save(state, out)  # type: ignore[arg-type]
            out.close()
        else:
            torch.save(state, tmp)
        tmp.replace(ckpt_dir / f"step_{step:08d}.pt")
    dist.barrier()


def slowed(batches: Any, delay_s: float) -> Iterator[Any]:
    """`batches`, each one `delay_s` late: the wait is in the main process, where the script
    gets its batch (a DataLoader's workers would prefetch a sleep in the dataset away)."""
    for batch in batches:
        time.sleep(delay_s)
        yield batch


def evaluate(seconds: float) -> None:
    print(f"evaluating for {seconds:g}s", flush=True)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        dist.all_reduce(torch.ones(1))
        time.sleep(0.1)


if __name__ == "__main__":
    main()
