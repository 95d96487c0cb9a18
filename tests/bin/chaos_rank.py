"""A rank for the chaos suite (tests/system/test_chaos.py): heartbeats through ftd_client, and
on the attempts its flags name, the misbehaviour the suite needs; speaks raw packets where a real
client never would."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from ftd_client import RankClient

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def say(what: str) -> None:
    print(f"rank {RANK} attempt {ATTEMPT} {what}", flush=True)


def raw_connection() -> socket.socket:
    """A second connection to the daemon from this rank's own process (so it is accepted)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(os.environ["FTD_SOCKET"])
    sock.settimeout(30)
    return sock


def beat(client: RankClient, interval: float, seconds: float, until: Path | None) -> None:
    """Heartbeat every `interval` for `seconds` (or, with `until`, until that file exists)."""
    deadline = time.monotonic() + seconds
    while (until is not None and not until.exists()) or (
        until is None and time.monotonic() < deadline
    ):
        client.heartbeat()
        time.sleep(interval)


def gloo_hang(client: RankClient, args: argparse.Namespace) -> None:
    """Allreduce every step; on attempts below --bad-attempts one rank (rank 1, rank 0, rank
    1 ...) goes silent before its fourth heartbeat and its peer waits for it in the allreduce."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    bad = (ATTEMPT + 1) % WORLD if args.bad_attempts > ATTEMPT else -1
    tensor = torch.ones(1)
    for step in range(args.beats):
        if bad == RANK and step == 3:
            say("hangs before its allreduce")
            time.sleep(3600)
        client.heartbeat()
        dist.all_reduce(tensor)
        time.sleep(args.interval)
    dist.destroy_process_group()
    say("done")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True)
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--beats", type=int, default=12)
    parser.add_argument("--until", type=Path, help="heartbeat until this file exists")
    parser.add_argument("--bad-attempts", type=int, default=1)
    parser.add_argument("--bad-rank", type=int, default=0)
    args = parser.parse_args()
    client = RankClient()
    client.wait_for_handshake()
    bad = args.bad_attempts > ATTEMPT and args.bad_rank == RANK
    say(f"up pid {os.getpid()}")
    mode = args.mode

    if mode == "beat":
        beat(client, args.interval, args.seconds, args.until)
    elif mode == "gloo-hang":
        return gloo_hang(client, args)
    elif mode == "bad-stack-signal" and bad:
        # Handshakes naming signals no rank may ask for, the last a number no signal has.
        with raw_connection() as sock:
            for value in (signal.SIGKILL, signal.SIGSTOP, -1, 0, True, "10", 2**70):
                hello = {"v": 1, "t": "hello", "id": 1, "stack_signal": value}
                sock.send(json.dumps(hello).encode())
                reply = json.loads(sock.recv(1 << 16))
                assert reply["ok"] is True, reply
            beat(client, args.interval, 0.3, None)
            say("hangs after a hello with stack_signal 2**70")
            time.sleep(3600)
    elif mode == "nested" and bad:
        with raw_connection() as sock:
            for packet in (b"[" * 60_000, b'{"a":' * 10_000 + b"1" + b"}" * 10_000):
                sock.send(packet)
            # Under the container limit, nested deeply, an answered request: it is refused too.
            deep = b'{"v":1,"t":"set","id":7,"timeouts":' + b"[" * 200 + b"]" * 200 + b"}"
            sock.send(deep)
            reply = json.loads(sock.recv(1 << 16))
            say(f"nested reply {json.dumps(reply)}")
        beat(client, args.interval, args.seconds, None)
    elif mode == "set-timeouts":
        with raw_connection() as sock:
            patch = {"rank_out_of_section_timeout": 5e-324}
            sock.send(json.dumps({"v": 1, "t": "set", "id": 3, "timeouts": patch}).encode())
            say(f"set reply {sock.recv(1 << 16).decode()}")
        beat(client, args.interval, 0, args.until)
    elif mode == "crash-then-hang":
        # Attempt 0: heartbeat until told, then rank 0 crashes; attempt 1: rank 1 goes silent.
        if ATTEMPT == 0:
            beat(client, args.interval, 0, args.until)
            if RANK == 0:
                say("crashes")
                sys.exit(3)
            time.sleep(3600)
        beat(client, args.interval, args.seconds, None)
        if ATTEMPT == 1 and RANK == 1:
            say("goes silent")
            time.sleep(3600)
    elif mode == "stubborn":
        # Attempt 0: rank --bad-rank crashes once every other rank is up (their markers in
        # --until, a directory); the others heartbeat until SIGTERM, which they ignore,
        # falling silent: ranks being stopped that would look hung. Later attempts finish.
        assert args.until is not None
        (args.until / f"up_{RANK}_{ATTEMPT}").touch()
        stopping: list[bool] = []
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
        if bad:
            others = [args.until / f"up_{rank}_{ATTEMPT}" for rank in range(WORLD) if rank != RANK]
            while not all(marker.exists() for marker in others):
                client.heartbeat()
                time.sleep(args.interval)
            beat(client, args.interval, 0.3, None)
            say("crashes")
            sys.exit(3)
        deadline = time.monotonic() + args.seconds
        while not stopping and (ATTEMPT == 0 or time.monotonic() < deadline):
            client.heartbeat()
            time.sleep(args.interval)
        if stopping:
            say("ignores SIGTERM")
            time.sleep(3600)
    else:
        beat(client, args.interval, args.seconds, None)
    client.close()
    say("done")


if __name__ == "__main__":
    main()
