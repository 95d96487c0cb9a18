"""Where the rendezvous store is, and where this node is as the others see it."""

from __future__ import annotations

import asyncio
import random
import socket
import struct
from collections.abc import Callable

from ftd.coordination.base import CoordinationError
from ftd.tasks import within
from ftd.text import escape, is_decimal


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
    if not host or not is_decimal(port) or not 0 < int(port) < 65536:
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


# c10d's TCPStore handshake (TCPStore.cpp, TCPStoreBackend.hpp): the client sends VALIDATE with
# the magic number, then PING with a nonce; a store answers the nonce. Host byte order, as
# c10d writes its integers.
_VALIDATE, _PING, _MAGIC = 0, 13, 0x3C85F7CE
_RETRY_S = (0.05, 1.0)
_SILENT_S = 2.0
"""A listener silent this long after the handshake is said to be so while the probe waits."""


async def probe_store(
    host: str, port: int, deadline: float, on_error: Callable[[str], object] | None = None
) -> None:
    """Return once a c10d store answers at host:port; CoordinationError (one line naming the
    endpoint) at `deadline` (the loop's clock) or as soon as something else answers there.
    `on_error` hears why each try that will be tried again failed.

    c10d's own client waits forever on a listener that accepts and says nothing, logging C++
    stacks as it retries; this probe is the event loop's, so it is bounded and cancellable
    (a signal), and the C++ client only ever meets a store that answered."""
    loop = asyncio.get_running_loop()
    shown = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    delay, why = _RETRY_S[0], "nothing listens there"
    nonce = random.randrange(1, 1 << 32)
    while (remaining := deadline - loop.time()) > 0:
        try:
            address = await within(_resolve(host, port), remaining)
            reader, writer = await within(asyncio.open_connection(address, port), remaining)
        except TimeoutError:
            why = "the connection did not complete"
            break
        except OSError as error:  # refused, unreachable, unknown name: the host may come up
            why = (error.strerror or str(error)).lower()
            if on_error is not None:
                on_error(why)
            await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
            delay = min(delay * 2, _RETRY_S[1])
            continue
        try:
            writer.write(struct.pack("=BI", _VALIDATE, _MAGIC) + struct.pack("=BI", _PING, nonce))
            await writer.drain()
            reply = await _answer(reader, deadline, on_error)
        except TimeoutError:
            raise CoordinationError(
                f"--rdzv-endpoint {shown}: something listens there but gave no answer of a "
                "c10d store within --rdzv-join-timeout (another program's port?)"
            ) from None
        except (asyncio.IncompleteReadError, OSError) as error:
            got = error.partial if isinstance(error, asyncio.IncompleteReadError) else b""
            said = f"answered {_preview(got)} and closed" if got else "closed the connection"
            raise CoordinationError(
                f"--rdzv-endpoint {shown} is not a c10d store: it {said}"
            ) from None
        finally:
            writer.close()
        if reply != struct.pack("=I", nonce):
            raise CoordinationError(
                f"--rdzv-endpoint {shown} is not a c10d store: it answered {_preview(reply)}"
            )
        return
    raise CoordinationError(
        f"no rendezvous store at --rdzv-endpoint {shown} within --rdzv-join-timeout: {why}",
        "store_lost",
    )


async def _resolve(host: str, port: int) -> str:
    """host's first address (OSError when it has none). In a thread of our own: a lookup the
    event loop makes itself (uvloop's) leaves an unretrieved error behind when cancelled."""
    infos = await asyncio.to_thread(socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"{host} has no address")
    return str(infos[0][4][0])


async def _answer(
    reader: asyncio.StreamReader, deadline: float, on_error: Callable[[str], object] | None
) -> bytes:
    """The store's 4-byte answer; a listener silent for _SILENT_S is said to be so, and waited
    for up to `deadline` (TimeoutError). readexactly keeps what came when cancelled."""
    loop = asyncio.get_running_loop()
    try:
        return await within(reader.readexactly(4), min(_SILENT_S, deadline - loop.time()))
    except TimeoutError:
        if on_error is not None:
            on_error("connected, but no answer of a c10d store yet")
    return await within(reader.readexactly(4), max(0.0, deadline - loop.time()))


def _preview(data: bytes) -> str:
    """A few bytes something else sent, safe to print."""
    return escape(repr(data[:16]), 80)
