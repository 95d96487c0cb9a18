"""A rank of a job of several nodes, torch-free, for the replica channel's live tests: in the
first attempt it writes a snapshot of step 1 into the slot its daemon grants (a valid header,
no tensors) and marks <out>/saved-<rank>, once <out>/save-2 exists one of step 2
(<out>/saved-2-<rank>), then waits to be stopped; in a later attempt it asks
its daemon what to restore (`ckr`, asked again while the daemon fetches from its peers:
`pending`) and writes the steps it holds to <out>/restored-<rank>.json, then exits 0."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from ftd_client import protocol
from ftd_client.snapshot_format import layout

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
IDS = iter(range(1, 1 << 30))
DATA_BYTES = 8 << 20
"""Big enough that a peer's answers to ten pulls overlap (the old cap of eight met)."""


def packet(message: dict[str, Any]) -> bytes:
    """`message` as one raw packet (written here as a rank may, not through ftd_client.wire)."""
    return json.dumps({"v": protocol.PROTOCOL_VERSION, **message}).encode()


def ask(sock: socket.socket, message: dict[str, Any]) -> dict[str, Any]:
    sock.send(packet({**message, "id": next(IDS)}))
    reply: dict[str, Any] = json.loads(sock.recv(65536))
    return reply


def save(sock: socket.socket, step: int) -> None:
    """A snapshot of `step` in the slot the daemon grants: its header, then zeros (sparse)."""
    header = layout(step, WORLD, RANK, 0, DATA_BYTES)
    size = header.data_offset + DATA_BYTES
    begin = {"t": protocol.CHECKPOINT_BEGIN, "step": step, "bytes": size, "world": WORLD}
    grant = ask(sock, begin)
    assert grant.get("ok"), grant
    with open(grant["path"], "wb") as snapshot:
        snapshot.write(header.pack())
        snapshot.truncate(size)
    done = ask(sock, {"t": protocol.CHECKPOINT_DONE, "step": step, "slot": grant["slot"]})
    assert done.get("ok"), done


def main() -> None:
    out = Path(sys.argv[1])
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.connect(os.environ["FTD_SOCKET"])
        sock.settimeout(60.0)
        if ATTEMPT == 0:
            save(sock, 1)
            (out / f"saved-{RANK}").touch()
            while not (out / "save-2").exists():
                time.sleep(0.05)
            save(sock, 2)
            (out / f"saved-2-{RANK}").touch()
            while True:
                time.sleep(3600)
        deadline = time.monotonic() + 60
        while True:
            reply = ask(sock, {"t": protocol.CHECKPOINT_RESTORE, "world": WORLD})
            if not reply.get("pending") or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    result = out / f"restored-{RANK}.json"
    result.with_suffix(".tmp").write_text(json.dumps(reply))
    result.with_suffix(".tmp").rename(result)


if __name__ == "__main__":
    main()
