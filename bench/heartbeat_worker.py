"""A bench rank: stays up, optionally heartbeating its daemon at --hz through ftd_client."""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hz", type=float, default=0.0, help="heartbeats per second (0: none)")
    args = parser.parse_args()
    if args.hz <= 0:
        while True:
            time.sleep(3600)
    from ftd_client import RankClient

    client = RankClient()  # the daemon's socket from the environment ftd serve sets
    period = 1.0 / args.hz
    deadline = time.monotonic()
    while True:
        client.heartbeat()
        deadline += period
        time.sleep(max(0.0, deadline - time.monotonic()))


if __name__ == "__main__":
    main()
