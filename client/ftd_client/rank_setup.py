"""What a rank sets up once for its daemon: a stack dump on the daemon's signal, and the send
buffer that queues its messages while the daemon is busy."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import socket
from typing import IO

log = logging.getLogger("ftd_client")

SNDBUF_ENV = "FTD_SOCKET_SNDBUF"


def register_stack_dump() -> tuple[IO[str] | None, int | None]:
    """On the daemon's signal, dump every thread's Python stack into the attempt's log
    directory; the dump runs in the signal handler, so it works while the main thread is
    stuck (in a collective, say). The open file and the signal, or (None, None)."""
    path = os.environ.get("FTD_STACKS_FILE")
    if not path:
        return None, None
    try:
        stack_file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (kept open)
    except OSError as error:
        log.warning("ftd: cannot register the stack dump: %s", error)
        return None, None
    try:
        faulthandler.register(stack_signal(), file=stack_file, all_threads=True)
    except (OSError, ValueError, RuntimeError) as error:
        stack_file.close()
        log.warning("ftd: cannot register the stack dump: %s", error)
        return None, None
    return stack_file, int(stack_signal())


def unregister_stack_dump(stack_file: IO[str]) -> None:
    faulthandler.unregister(stack_signal())
    stack_file.close()


def keep_stack_signal_off_this_thread() -> None:
    """For ftd_client's own threads: the stack signal is then handled by another thread, the
    main one where it can, whose frames stay still while the handler reads them (a handler on
    a helper thread walks the frames of a main thread that runs on: a SIGSEGV, seen)."""
    with contextlib.suppress(ValueError, OSError):
        signal.pthread_sigmask(signal.SIG_BLOCK, {stack_signal()})


def stack_signal() -> signal.Signals:
    return signal.Signals(int(os.environ.get("FTD_STACK_SIGNAL", int(signal.SIGUSR2))))


def size_send_buffer(sock: socket.socket) -> None:
    """The queue of messages waiting for the daemon is this socket's send buffer: the daemon
    sizes it for the job (FTD_SOCKET_SNDBUF); the kernel caps it at net.core.wmem_max."""
    try:
        size = int(os.environ.get(SNDBUF_ENV, "0"))
    except ValueError:
        return
    if size > 0:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, min(size, 2**30))
