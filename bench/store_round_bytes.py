"""What round 0's closing record costs the store that serves it: every one of N nodes reads a
record that lists the N members (b N bytes), b N² bytes in all, from one store process (c10d).

For N in `--members`: the closing record of N members (`--record`: `packed`, as ftd stores it
since record_body.py, of nodes named `node-00001.cluster.local` with IPv4 addresses; `real`, the
same record unpacked; `flat`, `--bytes-per-member` times N bytes) is set, then read N times (once
per node) by `--clients` threads, each on a connection of its own (torch's C++ client: the
threads run side by side, the store is kept busy; `assigned`: what ftd does since
assignment.py, each node's signed assignment set in one multi_set, each read once, by its
node); beside it N `add`s on the same connections
(an operation with no value: what a round's other ~11 operations per node cost). The store's
CPU (its process's user + system time, from /proc, in 10 ms ticks: coarse below 4,096) per read
and per add, and the wall time of the N reads: ftd's store (`ftd store`, as node rank 0 hosts
it) and torch 2.13's own libuv server, in the same run, each in a process of its own.

    PYTHONPATH=.:client python bench/store_round_bytes.py [--members 1024 4096 16384]
        [--record packed|real|flat|assigned] [--bytes-per-member 31] [--clients 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftd_client.store import tcp_store_client
from tcpstore_ops import server_process

from ftd.coordination.assignment import assignments_of
from ftd.coordination.records import RecordCodec, RoundMember, RoundRecord

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """The process's user + system CPU seconds (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def on_threads(clients: list[Any], total: int, op: Callable[[Any], object]) -> float:
    """`op` `total` times over the clients, each on a thread of its own: the wall seconds."""
    share = [total // len(clients) + (i < total % len(clients)) for i in range(len(clients))]

    def run(client: Any, count: int) -> None:
        for _ in range(count):
            op(client)

    threads = [threading.Thread(target=run, args=pair) for pair in zip(clients, share, strict=True)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def closing_record(members: int, record: str, per_member: int) -> bytes:
    """Round 0's closing record of `members`: `flat`, `per_member` bytes a member; `real`, the
    signed record of nodes named `node-00001.cluster.local` with IPv4 addresses, as ftd stored
    it before record_body.py; `packed`, that record as ftd stores it now."""
    if record == "flat":
        return b"m" * (per_member * members)
    addr = "10.{}.{}.{}".format
    rows = tuple(RoundMember(f"node-{i:05d}.cluster.local", addr(i >> 16, i >> 8 & 255, i & 255),
                             8, 29500) for i in range(members))  # fmt: skip
    round_record = RoundRecord(number=0, members=rows, restarts=0)
    if record == "packed":
        return RecordCodec("job", b"secret").encode("r0/closed", round_record).encode()
    return b"ftd1 " + b"0" * 64 + b" " + round_record.model_dump_json().encode()


def assignments(members: int) -> dict[str, bytes]:
    """Each member's signed assignment of the packed record's round, by its key."""
    rows = tuple(RoundMember(f"node-{i:05d}.cluster.local", f"10.0.{i >> 8}.{i & 255}", 8, 29500)
                 for i in range(members))  # fmt: skip
    round_record = RoundRecord(number=0, members=rows, restarts=0)
    codec = RecordCodec("job", b"secret")
    found = assignments_of(round_record, [r[0] for r in rows], list_max=0)
    return {f"r0/assign/{n}": codec.encode(f"r0/assign/{n}", a).encode() for n, a in found.items()}


def measure(
    kind: str, members: int, value: bytes | dict[str, bytes], clients: int
) -> dict[str, Any]:
    with server_process(kind) as (port, pid):
        conns = [tcp_store_client("127.0.0.1", port) for _ in range(clients)]
        before = cpu_s(pid)
        if isinstance(value, dict):  # the closer's one multi_set, then each node its own key
            conns[0].multi_set(list(value), list(value.values()))
            keys = iter(list(value))
            read_wall = on_threads(conns, members, lambda c: c.get(next(keys)))
            served = sum(len(v) for v in value.values())
            largest = max(len(v) for v in value.values())
        else:
            conns[0].set("closed", value)
            read_wall = on_threads(conns, members, lambda c: c.get("closed"))
            served, largest = len(value) * members, len(value)
        read_cpu = cpu_s(pid) - before
        before = cpu_s(pid)
        add_wall = on_threads(conns, members, lambda c: c.add("joined", 1))
        add_cpu = cpu_s(pid) - before
    return {
        "server": kind,
        "members": members,
        "record_bytes": largest,
        "served_bytes": served,
        "reads_store_cpu_s": round(read_cpu, 3),
        "read_store_cpu_us": round(read_cpu / members * 1e6, 1),
        "reads_wall_s": round(read_wall, 3),
        "add_store_cpu_us": round(add_cpu / members * 1e6, 1),
        "adds_wall_s": round(add_wall, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument(
        "--record", choices=["flat", "real", "packed", "assigned"], default="packed"
    )
    parser.add_argument("--bytes-per-member", type=int, default=31, help="for --record flat")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for members in args.members:
        value: bytes | dict[str, bytes] = (
            assignments(members)
            if args.record == "assigned"
            else closing_record(members, args.record, args.bytes_per_member)
        )
        for kind in ("ftd", "torch"):
            row = {"record": args.record, **measure(kind, members, value, args.clients)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
