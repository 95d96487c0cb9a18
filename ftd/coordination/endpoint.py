"""Where the rendezvous store is, and where this node is as the others see it."""

from __future__ import annotations

import socket

from ftd.coordination.base import CoordinationError


def parse_endpoint(endpoint: str, default_port: int = 29400) -> tuple[str, int]:
    """`host:port`, `[v6]:port`, `host` or `v6` (default port)."""
    text = endpoint.strip() or "127.0.0.1"
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":") or str(default_port)
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:  # a bare host name or IPv6 address
        host, port = text, str(default_port)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CoordinationError(f"--rdzv-endpoint {endpoint!r}: expected host:port")
    return host, int(port)


def is_local(host: str, local_addr: str) -> bool:
    if host in ("localhost", "127.0.0.1", "::1", local_addr, socket.gethostname()):
        return True
    try:
        return socket.gethostbyname(host) in ("127.0.0.1", local_addr)
    except OSError:
        return False


def route_address(host: str, port: int) -> str:
    """This machine's address on the way to host:port (no packet is sent)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            address: str = probe.getsockname()[0]
            return address
    except OSError:
        return socket.gethostname()
