"""CPU per operation of ftd's own TCPStore client (ftd/tcpstore/client.py: the daemon's
connections to the rendezvous store) against ftd's store server in a process of its own.

Each operation `--ops` times on one connection: check, get of a 200-byte and of a 31 KB value
(a round's closing record at 1,024 nodes), multi_get of 32 keys (node rank 0's keepalive read
of 32 nodes), add. The client's CPU (process time: its syscalls included) and the wall time,
in microseconds per operation.

    PYTHONPATH=.:client python bench/store_client_cpu.py [--ops 20000]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from tcpstore_ops import server  # ftd's store as `ftd store` runs it, in a process of its own

from ftd.tcpstore.client import StoreClient


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=20000)
    args = parser.parse_args()
    with server("ftd") as port:
        client = StoreClient("127.0.0.1", port, 10.0)
        client.set("small", b"x" * 200)
        client.set("big", b"y" * 31000)
        cases: list[tuple[str, Callable[[], object], int]] = [
            ("check", lambda: client.check(["small"]), args.ops),
            ("get 200 B", lambda: client.get("small"), args.ops),
            ("get 31 KB", lambda: client.get("big"), args.ops // 4),
            ("multi_get 32", lambda: client.multi_get(["small"] * 32), args.ops // 6),
            ("add", lambda: client.add("n", 1), args.ops),
        ]
        for name, op, n in cases:
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(n):
                op()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            print(f"{name:14s} CPU {cpu / n * 1e6:7.1f} us/op   wall {wall / n * 1e6:7.1f} us/op")
        client.close()


if __name__ == "__main__":
    main()
