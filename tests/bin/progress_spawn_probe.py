"""A plain script (no ftd import) that reports what python gave it: sys.argv, sys.orig_argv,
sys.path, its `__main__`, its environment, whether ftd's progress thread runs, and whether a
class defined here goes to a spawn-context worker and back (pickled by reference to
`__main__`). Run as a script or with `-m tests.bin.progress_spawn_probe`.

`--out DIR`: write <run id>/report_r<RANK>.json there. `--release FILE`: then wait for FILE (at most
60 s). `--raise`: then raise ValueError from a @record'ed main (the error file)."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

RANK = os.environ.get("RANK", "0")


class Shipped:
    """Defined in `__main__`: a spawn worker must import the script to unpickle it."""

    def __init__(self, value: int) -> None:
        self.value = value


def double(item: Shipped) -> Shipped:
    return Shipped(item.value * 2)


def facts() -> dict[str, object]:
    main = sys.modules["__main__"]
    return {
        "name": __name__,
        "main_is_this": main.__dict__ is globals(),
        "file": main.__dict__.get("__file__"),
        "cached": main.__dict__.get("__cached__"),
        "spec": getattr(main.__spec__, "name", None),
        "loader": type(main.__dict__.get("__loader__")).__name__,
        "package": main.__dict__.get("__package__"),
        "argv": sys.argv,
        "orig_argv": sys.orig_argv,
        "path": sys.path,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "progress_thread": any(t.name == "ftd-progress" for t in threading.enumerate()),
    }


def round_trip() -> dict[str, object]:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        back = pool.apply(double, (Shipped(21),))
    return {"value": back.value, "class": f"{type(back).__module__}.{type(back).__qualname__}"}


def fail() -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    @record  # type: ignore[misc]
    def failing_main() -> None:
        raise ValueError(f"probe failed on rank {RANK}")

    failing_main()


def main() -> None:
    report = facts()
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--release", type=Path)
    parser.add_argument("--raise", dest="fail", action="store_true")
    args = parser.parse_args()
    report["round_trip"] = round_trip()
    out = args.out / os.environ.get("TORCHELASTIC_RUN_ID", "none")
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"report_r{RANK}.tmp"
    tmp.write_text(json.dumps(report))
    tmp.replace(out / f"report_r{RANK}.json")
    print(f"reported r{RANK}", flush=True)
    deadline = time.monotonic() + 60
    while args.release is not None and not args.release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if args.fail:
        fail()


if __name__ == "__main__":
    main()
