"""One rank (no torch) that sends the daemon progress reports with a `host_us` of every kind on
the progress connection, then writes <--out>/sent.json and heartbeats until <--out>/release
exists (at most 120 s): the test reads the daemon's refusals."""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from ftd_client import RankClient, protocol


def packet(message: dict[str, Any]) -> bytes:
    """`message` as a raw packet, written by hand as a hostile rank may."""
    return json.dumps({"v": protocol.PROTOCOL_VERSION, **message}).encode()


HOSTILE = (-1, 1.5, 2**60, True, "80000", [1], {"us": 1})
"""Each refused by the decoder as `bad_progress`, as the same `fwd_us` is."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    client = RankClient()
    client.wait_for_handshake()
    counts = {"t": protocol.PROGRESS, "steps": 1, "called": 0, "returned": 0}
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.connect(os.environ["FTD_SOCKET"])
        sock.send(packet({**counts, "fwd_us": 5000, "host_us": 80_000}))
        for value in HOSTILE:
            sock.send(packet({**counts, "host_us": value}))
        sent = args.out / "sent.json"
        sent.with_suffix(".tmp").write_text(json.dumps({"sent": 1 + len(HOSTILE)}))
        sent.with_suffix(".tmp").rename(sent)
        deadline = time.monotonic() + 120
        while not (args.out / "release").exists() and time.monotonic() < deadline:
            client.heartbeat()
            time.sleep(0.05)
    client.close()


if __name__ == "__main__":
    main()
