"""A chatty rank (issue 28): opens and closes section `step` many times in a row, then
heartbeats outside any section for a while and exits 0 — or, with --hang, opens `step` once
more and never closes it. Prints what the client counted as dropped."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from ftd_client import RankClient

RANK = int(os.environ.get("RANK", "0"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sections", type=int, default=3000)
    parser.add_argument("--quiet-s", type=float, default=5.0)
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--hang", action="store_true")
    parser.add_argument("--mark", type=Path, default=None)
    parser.add_argument("--names", type=int, default=0, help="open and close s0..sN-1 first")
    parser.add_argument("--nest", type=int, default=0, help="leave N sections open first")
    args = parser.parse_args()
    client = RankClient()
    client.wait_for_handshake()
    client.heartbeat()
    for i in range(args.names):
        with client.section(f"s{i}"):
            client.heartbeat()
    for i in range(args.nest):
        client.start_section(f"n{i}")
    if args.names or args.nest:
        print(f"rank {RANK} refused {client.refused_sections} sections", flush=True)
        client.end_all_sections()
    print(f"rank {RANK} bursting pid {os.getpid()}", flush=True)
    if args.mark is not None:
        args.mark.with_name(f"{args.mark.name}.{RANK}.start").touch()
    for _ in range(args.sections):
        client.start_section("step")
        client.end_section("step")
    print(f"rank {RANK} burst done, dropped {client.dropped}", flush=True)
    if args.mark is not None:
        args.mark.with_name(f"{args.mark.name}.{RANK}.burst").touch()
    if args.hang:
        client.start_section("step")
        print(f"rank {RANK} hanging in step at {time.time():.6f}", flush=True)
        time.sleep(3600)
    deadline = time.monotonic() + args.quiet_s
    while time.monotonic() < deadline:
        client.heartbeat()
        time.sleep(args.interval)
    client.close()
    print(f"rank {RANK} done, dropped {client.dropped}", flush=True)


if __name__ == "__main__":
    main()
