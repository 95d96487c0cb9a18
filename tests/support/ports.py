"""Ports for the daemons and stores a test starts: free now, and below the kernel's ephemeral
range. A port from that range (bind to 0) may be taken, between the test's choice and the
daemon's bind, as the local port of any outgoing connection of the suite; a daemon told to host
its store there then cannot (seen once in CI)."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

LOWEST = 10000


def free_ports(count: int) -> list[int]:
    """`count` different ports nothing listens on now."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    chooser = random.SystemRandom()
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(200 * count):
            if len(ports) == count:
                return ports
            port = chooser.randrange(LOWEST, max(ephemeral, LOWEST + 1))
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            ports.append(port)
        raise OSError(f"no {count} free ports below {ephemeral}")


def free_port() -> int:
    return free_ports(1)[0]
