"""TCPStore operations through torch's C++ client: torch 2.13's own server against ftd's
(ftd/tcpstore, as `ftd store` runs it: an asyncio loop of its own), in the same run, each
server in a process of its own (as in a daemon, away from the clients' GIL).

Per server: `--ops` round trips of each of set, get, add and check on one connection, the
wake-up of a blocked wait after another client's set, and a barrier of `--clients` clients
(each adds to a counter and waits for the last), repeated `--barriers` times. Medians and
maxima in microseconds (the barrier in milliseconds); one JSON line per server with --json.

    .venv/bin/python bench/tcpstore_ops.py --ops 2000 --clients 16 --barriers 20
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ftd_client.store import tcp_store_client

TORCH_SERVER = (
    "import sys, time\n"
    "from ftd_client.store import tcp_store_server\n"
    "server = tcp_store_server('127.0.0.1', int(sys.argv[1]))\n"
    "time.sleep(1e9)\n"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def server(kind: str) -> Iterator[int]:
    """A store server of `kind` ("torch" or "ftd") in a process of its own: its port."""
    with server_process(kind) as (port, _):
        yield port


@contextlib.contextmanager
def server_process(kind: str) -> Iterator[tuple[int, int]]:
    """`server`, its port and its process id (to read its CPU)."""
    port = free_port()
    command = (
        [sys.executable, "-c", TORCH_SERVER, str(port)]
        if kind == "torch"
        else [sys.executable, "-m", "ftd", "store", "--host", "127.0.0.1", "--port", str(port)]
    )
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                break
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"the {kind} store did not start")
            time.sleep(0.05)
        yield port, process.pid
    finally:
        process.terminate()
        process.wait(10)


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def wake_ups(port: int, repeats: int) -> list[float]:
    """A client blocked in wait([key]); another sets it: the time from set to the wake-up."""
    waiter, setter = tcp_store_client("127.0.0.1", port), tcp_store_client("127.0.0.1", port)
    samples = []
    for index in range(repeats):
        key = f"wake/{index}"
        woke: list[float] = []

        def wait(key: str = key, woke: list[float] = woke) -> None:
            waiter.wait([key])
            woke.append(time.perf_counter())

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(0.002)  # the wait is in the server before the set (most of the time)
        set_at = time.perf_counter()
        setter.set(key, b"1")
        thread.join()
        samples.append(woke[0] - set_at)
    return samples


def barriers(port: int, clients: int, repeats: int) -> list[float]:
    """`clients` threads each add 1 and wait for the round's last: first arrival to last out."""
    stores = [tcp_store_client("127.0.0.1", port) for _ in range(clients)]
    samples = []
    for index in range(repeats):
        done: list[float] = []
        start = time.perf_counter()

        def arrive(store: Any, index: int = index, done: list[float] = done) -> None:
            if store.add(f"barrier/{index}", 1) == clients:
                store.set(f"barrier/{index}/all", b"1")
            store.wait([f"barrier/{index}/all"])
            done.append(time.perf_counter())

        threads = [threading.Thread(target=arrive, args=(s,)) for s in stores]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        samples.append(max(done) - start)
    return samples


def measure(name: str, port: int, args: argparse.Namespace) -> dict[str, Any]:
    client = tcp_store_client("127.0.0.1", port)
    client.set("k", b"v" * 64)
    client.set("n", b"0")
    ops = {
        "set": timed(lambda: client.set("k", b"v" * 64), args.ops),
        "get": timed(lambda: client.get("k"), args.ops),
        "add": timed(lambda: client.add("n", 1), args.ops),
        "check": timed(lambda: client.check(["k"]), args.ops),
        "wait_wakeup": wake_ups(port, args.wakeups),
    }
    result: dict[str, Any] = {"server": name}
    for op, samples in ops.items():
        result[op] = {
            "median_us": round(statistics.median(samples) * 1e6, 1),
            "p99_us": round(statistics.quantiles(samples, n=100)[98] * 1e6, 1),
            "max_us": round(max(samples) * 1e6, 1),
        }
    barrier = barriers(port, args.clients, args.barriers)
    result[f"barrier_{args.clients}"] = {
        "median_ms": round(statistics.median(barrier) * 1e3, 2),
        "max_ms": round(max(barrier) * 1e3, 2),
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--wakeups", type=int, default=200)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--barriers", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    results = []
    for kind in ("torch", "ftd"):
        with server(kind) as port:
            results.append(measure(kind, port, args))
    for result in results:
        if args.json:
            print(json.dumps(result))
        else:
            cells = ", ".join(
                f"{op} " + "/".join(str(value) for value in v.values())
                for op, v in result.items()
                if isinstance(v, dict)
            )
            print(f"{result['server']:>5}: {cells}  (median/p99/max µs; barrier median/max ms)")


if __name__ == "__main__":
    main()
