"""Every c10d TCPStore of ftd is built here, daemon and ranks alike.

A TCPStore server left to itself listens on every interface, whatever host it is given. Here
the listening socket is bound first, to the address asked for only, and handed to the store
(`master_listen_fd`): a store meant for 127.0.0.1 is reachable from this machine alone, and
`0.0.0.0` has to be asked for.

torch is imported when a store is made (this package stays importable without it).
"""

from __future__ import annotations

import contextlib
import os
import socket
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import Store, TCPStore

DEFAULT_TIMEOUT_S = 30.0
NO_TIMEOUT = timedelta(days=365)
"""For a wait that lasts as long as what it waits for (a round, a job): never a timeout that
expires, and so never c10d's 'timed out' warning."""
LISTEN_BACKLOG = 4096
WILDCARDS = frozenset({"", "0.0.0.0", "::", "*"})


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on `host` (a name or an address; a wildcard means every
    interface) and `port` (0: a free one)."""
    bind_host = "" if host in WILDCARDS else host.strip("[]")
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    if bind_host and family == socket.AF_INET:
        bind_host = socket.gethostbyname(bind_host)  # a host name: the address it stands for
    return socket.create_server(
        (bind_host, port), family=family, backlog=LISTEN_BACKLOG, dualstack_ipv6=False
    )


def tcp_store_server(host: str, port: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S) -> TCPStore:
    """Blocking: a listening TCPStore server bound to `host` only (port 0 picks a free one)."""
    from torch.distributed import TCPStore

    sock = listening_socket(host, port)
    bound_port = int(sock.getsockname()[1])
    fd = sock.detach()  # the store owns the descriptor from here on
    try:
        return TCPStore(
            host_name=host if host not in WILDCARDS else "127.0.0.1",
            port=bound_port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            use_libuv=True,
            master_listen_fd=fd,
        )
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def tcp_store_client(host: str, port: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> TCPStore:
    """Blocking: a client connection to the TCPStore at host:port."""
    from torch.distributed import TCPStore

    return TCPStore(
        host_name=host.strip("[]"),
        port=port,
        is_master=False,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        use_libuv=True,
    )


def wait_keys(store: Store, keys: list[str], timeout_s: float | None = None) -> bool:
    """Blocking: whether every key exists within the timeout (None: no timeout);
    DistNetworkError when the store is gone."""
    from torch.distributed import DistNetworkError, DistStoreError

    try:
        store.wait(keys, NO_TIMEOUT if timeout_s is None else timedelta(seconds=timeout_s))
    except DistNetworkError:
        raise
    except DistStoreError:
        return False
    return True
