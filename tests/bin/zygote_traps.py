"""A rank that reports what a fresh interpreter would have, and exercises what breaks after a
fork: DataLoader workers, torch.multiprocessing spawn, gloo, atexit and buffered output."""

from __future__ import annotations

import sys

PRELOADED = "torch" in sys.modules  # forked from the zygote: torch came with the fork

import argparse  # noqa: E402
import atexit  # noqa: E402
import ctypes  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGPIPE", "SIGXFSZ", "SIGUSR1", "SIGCHLD", "SIGQUIT")
PR_GET_PDEATHSIG = 2


def facts() -> dict[str, object]:
    """Taken before anything of the script changes them."""
    libc = ctypes.CDLL(None)
    pdeathsig = ctypes.c_int(0)
    libc.prctl(PR_GET_PDEATHSIG, ctypes.byref(pdeathsig), 0, 0, 0)
    main = sys.modules["__main__"]
    return {
        "preloaded": PRELOADED,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "session_leader": os.getsid(0) == os.getpid(),
        "group_leader": os.getpgid(0) == os.getpid(),
        "pdeathsig": pdeathsig.value,
        "name": __name__,
        "main_is_this": main.__dict__ is globals(),
        "file": main.__dict__.get("__file__"),
        "spec": getattr(main.__spec__, "name", None),
        "argv": sys.argv,
        "orig_argv": sys.orig_argv,
        "path": sys.path,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "signals": {name: repr(signal.getsignal(signal.Signals[name])) for name in SIGNALS},
        "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "faulthandler": faulthandler.is_enabled(),
        "write_through": getattr(sys.stdout, "write_through", None),
        "random": random.random(),
        "stdout_is_log": os.path.realpath(f"/proc/self/fd/{sys.stdout.fileno()}"),
    }


def thread_facts() -> dict[str, object]:
    import numpy
    import torch

    return {
        "torch_threads": torch.get_num_threads(),
        # ftd's own progress sampler aside (client/ftd_client/progress.py): the pools' threads
        "threads": len(os.listdir("/proc/self/task"))
        - sum(t.name == "ftd-progress" for t in threading.enumerate()),
        "np_random": float(numpy.random.random()),
    }


class Squares:
    """A map-style dataset, defined in __main__ so spawn workers must re-import the script."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> object:
        import torch

        return torch.tensor([index * index, os.getpid()])


def dataloader_sums() -> dict[str, object]:
    from torch.utils.data import DataLoader

    results: dict[str, object] = {}
    for context in ("fork", "spawn"):
        loader = DataLoader(
            Squares(),  # type: ignore[arg-type]
            batch_size=2,
            num_workers=2,
            multiprocessing_context=context,
        )
        batches = list(loader)
        results[context] = {
            "sum": int(sum(int(batch[:, 0].sum()) for batch in batches)),
            "workers": len({int(pid) for batch in batches for pid in batch[:, 1]} - {os.getpid()}),
        }
    return results


def spawned(index: int, out: str) -> None:
    Path(out, f"mp_spawn_r{RANK}_{index}").write_text(str(os.getpid()))


def mp_spawn(out: Path) -> list[str]:
    import torch.multiprocessing as mp

    mp.spawn(spawned, args=(str(out),), nprocs=2, join=True)
    return sorted(p.name for p in out.glob(f"mp_spawn_r{RANK}_*"))


def allreduce() -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    tensor = torch.ones(2) * (RANK + 1)
    dist.all_reduce(tensor)
    dist.barrier()
    dist.destroy_process_group()
    return float(tensor[0])


def cuda_check() -> dict[str, object]:
    import torch

    device = torch.device(
        "cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    )
    value = (torch.ones(4, device=device) * 2).sum().item()
    return {"cuda_sum": value, "device": str(device)}


def late_writer(path: Path) -> None:
    time.sleep(0.3)
    path.write_text("written by a non-daemon thread")


LEFT_OPEN: object = None


def main() -> None:
    global LEFT_OPEN
    before = facts()
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--info", action="store_true")
    parser.add_argument("--dataloader", action="store_true")
    parser.add_argument("--mp-spawn", action="store_true")
    parser.add_argument("--allreduce", action="store_true")
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--atexit", action="store_true")
    parser.add_argument("--exit", type=int, default=None)
    parser.add_argument("--hang", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, object] = {}
    if args.info:
        report.update(before)
        report.update(thread_facts())
    if args.dataloader:
        report["dataloader"] = dataloader_sums()
    if args.mp_spawn:
        report["mp_spawn"] = mp_spawn(args.out)
    if args.allreduce:
        report["allreduce"] = allreduce()
    if args.cuda:
        report.update(cuda_check())
    (args.out / f"report_a{ATTEMPT}_r{RANK}.json").write_text(json.dumps(report))
    if args.atexit:
        atexit.register(print, f"atexit ran r{RANK}")
        LEFT_OPEN = open(args.out / f"unclosed_r{RANK}", "w")  # noqa: SIM115 - on purpose
        LEFT_OPEN.write("flushed when the interpreter ends")  # type: ignore[attr-defined]
        threading.Thread(target=late_writer, args=(args.out / f"thread_r{RANK}",)).start()
        sys.stdout.write(f"no newline r{RANK}")
    if args.hang:
        print(f"hanging a{ATTEMPT} r{RANK} pid {os.getpid()}", flush=True)
        while True:
            time.sleep(3600)
    if args.exit is not None:
        sys.exit(args.exit)


if __name__ == "__main__":
    main()
