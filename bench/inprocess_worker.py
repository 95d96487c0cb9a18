"""A rank for bench/inprocess_restart.py: the first round faults once, the next one resumes.

Every (re)start of the training function writes `<out>/a<attempt>_i<iteration>_s<slot>.json`
with wall-clock (`time.time()`) stamps: `pg_up` (`init_process_group("gloo")` returned) and
`allreduce` (its first allreduce returned): training has resumed once every rank has it.

In the first round (attempt 0, iteration 0) every rank reaches a barrier past its first
allreduce; then rank `--fault-rank` writes `<out>/fault.json` and faults (`raise`: an exception
in the training function; `exit`: the process dies), while the others go on allreducing, so
they are blocked waiting for it. Any later round ends after its first allreduce and a barrier.

With `--wrap` the function runs under ftd_client.inprocess.Wrapper (restarted in-process);
without, it is a plain torchrun script (an exception exits 1 and the launcher restarts it).
"""

from __future__ import annotations

import time

T0 = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SLOT = int(os.environ["RANK"])
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RESPAWNED = "FTD_INPROCESS_RESPAWN" in os.environ

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--wrap", action="store_true")
parser.add_argument("--inject", choices=["raise", "exit"], default="raise")
parser.add_argument("--fault-rank", type=int, default=1)
parser.add_argument("--nvrx-import", action="store_true", help="NVRx's inprocess, unmodified")
args = parser.parse_args()


def write(name: str, payload: dict[str, object]) -> None:
    tmp = args.out / f".{name}.tmp"
    tmp.write_text(json.dumps(payload))
    tmp.replace(args.out / name)


def train(iteration: int) -> None:
    dist.init_process_group("gloo")
    marks: dict[str, object] = {"pid": os.getpid(), "t0": T0, "pg_up": time.time()}
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    marks["allreduce"] = time.time()
    marks["world"] = dist.get_world_size()
    write(f"a{ATTEMPT}_i{iteration}_s{SLOT}.json", marks)
    dist.barrier()
    if ATTEMPT == 0 and iteration == 0 and not RESPAWNED:
        if args.fault_rank == SLOT:
            write("fault.json", {"time": time.time(), "pid": os.getpid(), "kind": args.inject})
            if args.inject == "exit":
                os._exit(1)
            raise RuntimeError("injected fault")
        while True:  # blocked on the faulting rank until its fault is dealt with
            dist.all_reduce(tensor)
    dist.destroy_process_group()


if args.wrap:
    if args.nvrx_import:  # NVRx's API as written for it: ftd's under --restart-mode inprocess
        from datetime import timedelta

        from nvidia_resiliency_ext import inprocess  # type: ignore[import-not-found,no-redef]

        timeouts = {"soft_timeout": timedelta(seconds=60), "hard_timeout": timedelta(seconds=90)}
    else:
        from ftd_client import inprocess

        timeouts = {"soft_timeout": 60, "hard_timeout": 90}

    @inprocess.Wrapper(**timeouts)
    def wrapped(call_wrapper: inprocess.CallWrapper | None = None) -> None:
        assert call_wrapper is not None
        train(call_wrapper.iteration)

    wrapped()
else:
    train(0)
