"""A test rank with behaviours chosen by flags; imports torch only when a flag needs it."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ.get("RANK", "0"))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, help="directory for marker files")
    parser.add_argument("--allreduce", action="store_true", help="gloo group + one allreduce")
    parser.add_argument("--dump-env", action="store_true")
    parser.add_argument("--fail-attempts", type=int, default=0, help="fail while attempt < N")
    parser.add_argument("--fail-rank", default="0", help="rank that fails, or 'rotate'")
    parser.add_argument("--fail-mode", default="raise", help="raise | exit:<code> | signal:<NAME>")
    parser.add_argument("--record", action="store_true", help="wrap main in torch's @record")
    parser.add_argument("--hang", action="store_true", help="sleep forever once ready")
    parser.add_argument("--hang-attempts", type=int, default=0, help="hang while attempt < N")
    parser.add_argument(
        "--hang-while-paired",
        action="store_true",
        help="hang on the first attempt and whenever other nodes take part; finish alone",
    )
    parser.add_argument("--hang-until", type=Path, help="once ready, wait for this file to exist")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep once ready")
    parser.add_argument(
        "--until",
        type=Path,
        help="once ready, print a step line every 0.1 s until this file exists, then finish; "
        "a file fail_a<attempt>_r<rank> in --out makes that rank fail first",
    )
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--children", action="store_true", help="start a child and a setsid one")
    parser.add_argument("--say", default="", help="print this to stdout and stderr")
    return parser.parse_args()


def mark(out: Path | None, name: str, payload: object = "") -> None:
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{name}.tmp"
    tmp.write_text(json.dumps(payload))
    tmp.replace(out / name)


def fail(mode: str) -> None:
    kind, _, arg = mode.partition(":")
    if kind == "exit":
        sys.exit(int(arg))
    if kind == "signal":
        signal.signal(signal.Signals[arg], signal.SIG_DFL)
        os.kill(os.getpid(), signal.Signals[arg])
        time.sleep(10)
    raise RuntimeError(f"injected failure on rank {RANK} attempt {ATTEMPT}")


def main() -> None:
    args = parse_args()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.say:
        print(f"{args.say} out rank {RANK}", flush=True)
        print(f"{args.say} err rank {RANK}", file=sys.stderr, flush=True)
    if args.dump_env:
        mark(args.out, f"env_{RANK}.json", dict(os.environ))
    if args.children:
        child = subprocess.Popen(["sleep", "600"])
        escaped = subprocess.Popen(["sleep", "601"], start_new_session=True)
        print(f"children r{RANK} {child.pid} {escaped.pid}", flush=True)
    if args.allreduce:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        tensor = torch.ones(4) * (RANK + 1)
        dist.all_reduce(tensor)
        world = dist.get_world_size()
        assert tensor[0].item() == world * (world + 1) / 2, tensor
        mark(args.out, f"allreduce_a{ATTEMPT}_r{RANK}", tensor.tolist())
        dist.barrier()  # every rank marked before one fails (a rank stopped first loses its mark)
    failing_rank = (
        ATTEMPT % int(os.environ["WORLD_SIZE"])
        if args.fail_rank == "rotate"
        else int(args.fail_rank)
    )
    if args.fail_attempts > ATTEMPT and failing_rank == RANK:
        fail(args.fail_mode)
    mark(args.out, f"ready_a{ATTEMPT}_r{RANK}", os.getpid())
    print(f"ready a{ATTEMPT} r{RANK} pid {os.getpid()}", flush=True)
    if args.sleep:
        time.sleep(args.sleep)
    while args.hang_until is not None and not args.hang_until.exists():
        time.sleep(0.05)  # test scaffolding: the test creates the file when it is done
    step = 0
    while args.until is not None and not args.until.exists():
        if args.out is not None and (args.out / f"fail_a{ATTEMPT}_r{RANK}").exists():
            fail(args.fail_mode)
        print(f"step a{ATTEMPT} r{RANK} {step}", flush=True)
        step += 1
        time.sleep(0.1)
    paired = int(os.environ["WORLD_SIZE"]) > int(os.environ["LOCAL_WORLD_SIZE"])
    if (
        args.hang
        or args.hang_attempts > ATTEMPT
        or (args.hang_while_paired and (paired or not ATTEMPT))
    ):
        while True:
            time.sleep(3600)
    if args.allreduce:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    if "--record" in sys.argv:
        from torch.distributed.elastic.multiprocessing.errors import record

        record(main)()
    else:
        main()
