"""A rank of a job that cannot move past one step: it resumes from the iteration in
--iteration-file (NVRx's checkpoint iteration file, which global rank 0 rewrites after every
step), and global rank 0 exits 1 when it reaches --fail-at, in every attempt; the other ranks
make steps until they are stopped. Torch-free."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

RANK = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iteration-file", type=Path, required=True)
    parser.add_argument("--fail-at", type=int, default=5)
    args = parser.parse_args()
    try:
        step = int(args.iteration_file.read_text())
    except (FileNotFoundError, ValueError):
        step = 0
    print(f"rank {RANK} attempt {ATTEMPT} resumes after step {step}", flush=True)
    while True:
        step += 1
        time.sleep(0.05)
        if RANK == 0 and step >= args.fail_at:
            print(f"rank {RANK} attempt {ATTEMPT} fails in step {step}", flush=True)
            raise SystemExit(1)
        if RANK == 0:
            tmp = args.iteration_file.with_suffix(".tmp")
            tmp.write_text(f"{step}\n")
            tmp.replace(args.iteration_file)


if __name__ == "__main__":
    main()
