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
    # The rank side of heartbeats (ftd_client.rank.RankClient, see docs/ARCHITECTURE.md).
    from ftd_client.rank import RankClient  # type: ignore[import-not-found]

    client = RankClient.from_env() if hasattr(RankClient, "from_env") else RankClient()
    period = 1.0 / args.hz
    deadline = time.monotonic()
    while True:
        client.heartbeat()
        deadline += period
        time.sleep(max(0.0, deadline - time.monotonic()))


if __name__ == "__main__":
    main()
