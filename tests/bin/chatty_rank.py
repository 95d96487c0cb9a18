"""A rank that prints a lot (tests/ranks/test_rank_output.py, bench/rank_output.py).

Each line is `r<rank> a<attempt> <n> <fill>`, whole and checkable. `--crash-first`: local rank
0 of the first attempt exits 1 once it printed, the others wait to be stopped. `--report DIR`:
each rank writes how long its printing took. `--go FILE`: wait for the file before exiting 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=float, default=1.0, help="MiB to print per attempt")
    parser.add_argument("--line-bytes", type=int, default=1024)
    parser.add_argument("--stderr", action="store_true", help="every tenth line to stderr too")
    parser.add_argument("--rate-mb-s", type=float, default=0.0, help="0: as fast as it can")
    parser.add_argument("--crash-first", action="store_true")
    parser.add_argument("--report", type=Path)
    parser.add_argument("--go", type=Path)
    args = parser.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    fill = chr(ord("a") + rank % 26)
    head = f"r{rank} a{attempt} "
    lines = int(args.mib * (1 << 20) / args.line_bytes)
    started = time.monotonic()
    for number in range(lines):
        text = f"{head}{number} "
        line = text + fill * max(0, args.line_bytes - len(text) - 1)
        print(line)
        if args.stderr and number % 10 == 0:
            print(line, file=sys.stderr)
        if args.rate_mb_s:
            due = started + (number + 1) * args.line_bytes / (args.rate_mb_s * 1e6)
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    took = time.monotonic() - started
    if args.report is not None:
        args.report.mkdir(parents=True, exist_ok=True)
        report = {"seconds": took, "lines": lines, "bytes": lines * args.line_bytes}
        (args.report / f"r{rank}_a{attempt}.json").write_text(json.dumps(report))
    if args.crash_first and attempt == 0:
        if rank == 0:
            return 1
        while True:
            time.sleep(1)
    if args.go is not None:
        while not args.go.exists():
            time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
