"""A rank for the dashboard and `ftd top` tests: heartbeats inside a `step` section until it
is stopped (at most 10 minutes)."""

import os
import time

from ftd_client import RankClient

RANK = os.environ.get("RANK", "0")
ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

client = RankClient()
client.heartbeat()
print(f"dash rank {RANK} attempt {ATTEMPT} up pid {os.getpid()}", flush=True)
deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    with client.section("step"):
        time.sleep(1.0)
    client.heartbeat()
