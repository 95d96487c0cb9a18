"""One rank that knocks on the daemon's newer doors (issue 39) and writes what it saw to
<--out>/door.json: the test asserts on that and on the daemon.

- `fifo-slot`: begins a snapshot, replaces its slot with a FIFO and says it is done;
- `pg-empty`: a progress report with none of its counts (`{"v":1,"t":"pg"}`);
- `auto-names`: progress reports that open and close N distinct automatic sections;
- `ckr-flood`: N restore requests (each would be an event);
- `cks-alternate`: N pairs of `cks` far ahead, then "restored from disk" at step 0;
- `section-hang` (imports torch): a few optimizer steps, then a section that has no timeout
  opened and never closed.
Each mode but section-hang then heartbeats until <--out>/release exists (at most 120 s).
"""

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


ID = iter(range(1, 10**9))


def connect() -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(os.environ["FTD_SOCKET"])
    sock.settimeout(60)
    return sock


def ask(sock: socket.socket, message: dict[str, Any]) -> dict[str, Any]:
    sock.send(packet({**message, "id": next(ID)}))
    reply: dict[str, Any] = json.loads(sock.recv(1 << 16))
    return reply


def counts(steps: int) -> dict[str, Any]:
    return {"t": protocol.PROGRESS, "steps": steps, "called": 0, "returned": 0}


def fifo_slot(sock: socket.socket) -> dict[str, Any]:
    grant = ask(sock, {"t": protocol.CHECKPOINT_BEGIN, "step": 1, "bytes": 4096, "world": 1})
    if not grant.get("ok"):
        return {"grant": grant}
    path = Path(grant["path"])
    path.unlink(missing_ok=True)
    os.mkfifo(path, 0o600)
    done = ask(sock, {"t": protocol.CHECKPOINT_DONE, "step": 1, "slot": grant["slot"]})
    return {"grant": grant, "done": done}


def auto_names(sock: socket.socket, n: int) -> dict[str, Any]:
    for i in range(n):
        sock.send(packet({**counts(1), "auto": {f"auto:n{i}": 1}}))
        sock.send(packet(counts(1)))
        if i % 64 == 63:
            time.sleep(0.01)  # the socket's queue: let the daemon read
    return {"sent": n}


def ckr_flood(sock: socket.socket, n: int) -> dict[str, Any]:
    replies = [ask(sock, {"t": protocol.CHECKPOINT_RESTORE, "world": 1}) for _ in range(n)]
    return {"sent": n, "ok": sum(1 for reply in replies if reply.get("ok"))}


def cks_alternate(sock: socket.socket, n: int) -> dict[str, Any]:
    for _ in range(n):
        sock.send(packet({"t": protocol.CHECKPOINT_SEEN, "step": 2**53}))
        sock.send(packet({"t": protocol.CHECKPOINT_SEEN, "step": 0, "restored": 1}))
    return {"sent": n}


def section_hang(client: RankClient) -> None:
    import torch

    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(20):
        optimizer.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        client.heartbeat()
        time.sleep(0.05)
    client.start_section("untimed")
    print(f"hanging in an untimed section at {time.time():.3f}", flush=True)
    while True:  # heartbeats go on: only progress can tell
        client.heartbeat()
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("-n", type=int, default=1000)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    client = RankClient()
    client.wait_for_handshake()
    if args.mode == "section-hang":
        section_hang(client)
    with connect() as sock:
        if args.mode == "fifo-slot":
            result = fifo_slot(sock)
        elif args.mode == "pg-empty":
            sock.send(b'{"v":1,"t":"pg"}')
            result = {"sent": 1}
        elif args.mode == "auto-names":
            result = auto_names(sock, args.n)
        elif args.mode == "ckr-flood":
            result = ckr_flood(sock, args.n)
        elif args.mode == "cks-alternate":
            result = cks_alternate(sock, args.n)
        else:
            raise SystemExit(f"unknown mode {args.mode}")
        done = args.out / "door.json"
        done.with_suffix(".tmp").write_text(json.dumps(result))
        done.with_suffix(".tmp").rename(done)
        deadline = time.monotonic() + 120
        while not (args.out / "release").exists() and time.monotonic() < deadline:
            client.heartbeat()
            time.sleep(0.05)
    client.close()


if __name__ == "__main__":
    main()
