"""A rank that prints a secret as jobs do (`HF_TOKEN=<--secret>` on stderr), says it is up on
stdout, then heartbeats until stopped (tests/api/test_rank_files_auth.py reads its output through
the API). The daemon's stack signal (SIGUSR2) dumps its Python stacks into FTD_STACKS_FILE
(ftd_client's handler)."""

import argparse
import os
import sys
import time

from ftd_client import RankClient

RANK = int(os.environ.get("RANK", "0"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--secret", required=True)
    args = parser.parse_args()
    client = RankClient()
    client.heartbeat()
    print(f"HF_TOKEN={args.secret}", file=sys.stderr, flush=True)
    print(f"secret rank {RANK} up pid {os.getpid()}", flush=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        time.sleep(0.5)
        client.heartbeat()


if __name__ == "__main__":
    main()
