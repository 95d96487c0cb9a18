"""A rank for the operator-truth tests (tests/test_dashboard_truth.py): heartbeats inside a
`step` section; rank 1 fails with exit code 3 (an error file naming `RuntimeError: boom
<attempt>` and a traceback on stderr first) on the attempts before --fail-until, or once the file
--trigger names exists; --slow-stop S: a SIGTERM ends it S seconds later (a restart that shows)."""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from ftd_client import RankClient

RANK = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def fail() -> None:
    message = f"RuntimeError: boom {ATTEMPT}"
    print(f'Traceback (most recent call last):\n  File "truth_rank.py"\n{message}', file=sys.stderr)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        Path(error_file).write_text(json.dumps({"message": message, "timestamp": int(time.time())}))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-until", type=int, default=0)
    parser.add_argument("--trigger", default="")
    parser.add_argument("--slow-stop", type=float, default=0.0)
    args = parser.parse_args()
    if args.slow_stop:
        signal.signal(signal.SIGTERM, lambda *_: (time.sleep(args.slow_stop), os._exit(0)))
    client = RankClient()
    client.heartbeat()
    print(f"truth rank {RANK} attempt {ATTEMPT} up pid {os.getpid()}", flush=True)
    if RANK == 1 and args.fail_until > ATTEMPT:
        fail()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        with client.section("step"):
            time.sleep(0.2)
        client.heartbeat()
        if RANK == 1 and args.trigger and Path(args.trigger).exists():
            fail()


if __name__ == "__main__":
    main()
