"""A rank of a job of several nodes that asks its daemon to restore it (`ckr`) in every world
from 1 to --worlds, as fast as the daemon answers (docs/checkpoint.md, the pulls' budgets),
writes what it was answered to <out>/flood-<rank>.json, then waits for <out>/stop (the test's
word) and exits. Standard library and ftd_client.protocol only: no torch."""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

from ftd_client import protocol


def packet(message: dict[str, object]) -> bytes:
    """`message` as one raw packet (written here as a rank may, not through ftd_client.wire)."""
    return json.dumps({"v": protocol.PROTOCOL_VERSION, **message}).encode()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--worlds", type=int, default=3000)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    answers: dict[str, int] = {}
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.connect(os.environ["FTD_SOCKET"])
        sock.settimeout(10.0)
        for world in range(1, args.worlds + 1):
            ask = {"t": protocol.CHECKPOINT_RESTORE, "id": world, "world": world}
            sock.send(packet(ask))
            reply = json.loads(sock.recv(65536))
            kind = "pending" if reply.get("pending") else "agree" if reply.get("agree") else "other"
            answers[kind] = answers.get(kind, 0) + 1
    done = args.out / f"flood-{rank}.json"
    done.with_suffix(".tmp").write_text(json.dumps(answers))
    done.with_suffix(".tmp").rename(done)
    while not (args.out / "stop").exists():
        time.sleep(0.05)


if __name__ == "__main__":
    main()
