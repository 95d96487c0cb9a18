"""The workers' store in a process of its own: ftd's `TcpStoreServer` on uvloop, beside the
daemon, so that a whole job's `init_process_group` never stalls the daemon's loop.

Every rank of the job connects to node rank 0's workers' store at once, and under torch's
scalable NCCL init every rank then WAITs on, and MULTI_GETs, all of the R/128 roots' keys. On
the daemon's own loop that burst stalled it once per init (0.75 s at 8,192 ranks, 2.7 s at
16,384: bench/WORKERS_STORE.md), and with it every timer of the loop: the hang verdicts of node
0's ranks. In a process of its own the same server costs the daemon nothing but a pipe.

The child (`python -m ftd.ranks.store_process HOST PORT DAEMON_PID [--on-request]`) imports
ftd.tcpstore and uvloop, never torch. It asks the kernel for SIGKILL when the daemon's thread
that started it dies (PR_SET_PDEATHSIG), and leaves at once when the daemon died before it
asked. It listens at once, or, with `--on-request` (a fixed `--master-port`, which only the
switch of stores frees), when the daemon writes a line on its stdin. Then it writes one line on
its stdout: the port, or `error <why>`. It ends when its stdin closes, or when killed.

The daemon reads that line through `decode_port_line`: at most PORT_LINE_MAX_BYTES, a port as
ASCII digits in 1..65535, or the child's own error; anything else is a refusal counted under
`tcp_store` and an OSError of one line, which the workers' stores retry like a failed bind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import resource
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import ftd_client

import ftd
from ftd.refusals import Refusals
from ftd.tasks import within
from ftd.tcpstore.server import MAX_CONNECTIONS, TcpStoreServer
from ftd.text import EscapingFormatter, escape, is_decimal

log = logging.getLogger("ftd.store")

PORT_LINE_MAX_BYTES: Final = 256
"""The child's one line, newline included; a longer one is refused unread."""
START_TIMEOUT_S: Final = 60.0
"""From the process's start (or the daemon's request) to its line: an interpreter, uvloop and
ftd.tcpstore imported on a loaded machine, then a bind."""
WHY_MAX_CHARS: Final = 200
PR_SET_PDEATHSIG: Final = 1
ON_REQUEST: Final = "--on-request"
SPARE_DESCRIPTORS: Final = 64


class StoreProcessError(OSError):
    """The store's process did not come to listen; the text says why, in one line."""


@dataclass(frozen=True)
class PortLine:
    """What the child's line said: the port it listens on, or why there is none (`why`, one
    escaped line), and the refusal's cause when the line was no port and no error of its own."""

    port: int | None
    why: str = ""
    refusal: str | None = None


def decode_port_line(data: bytes) -> PortLine:
    """The child's output up to its first newline (read by `read_port_line`: at most
    PORT_LINE_MAX_BYTES + 1 bytes), decoded: a port is written as `str(port)` would write it.
    Never raises."""
    line, newline, _ = data.partition(b"\n")
    if len(line) >= PORT_LINE_MAX_BYTES:
        return _refused("store_process_line_too_long", f"over {PORT_LINE_MAX_BYTES} bytes")
    if not newline:
        if not line:
            return PortLine(None, "it ended without saying a port")
        return _refused("store_process_line_cut", "a line cut short by its end")
    if line.startswith(b"error "):
        said = line[len(b"error ") :].decode("utf-8", "replace")
        return PortLine(None, escape(said, WHY_MAX_CHARS) or "an error without words")
    text = line.decode("ascii", "replace")
    if not is_decimal(text) or len(text) > 5 or str(port := int(text)) != text:
        return _refused("store_process_no_port", f"no port: {escape(text, 40)!r}")
    if not 1 <= port <= 65535:
        return _refused("store_process_port_out_of_range", f"port {port} is out of range")
    return PortLine(port)


def _refused(cause: str, why: str) -> PortLine:
    return PortLine(None, f"its line was refused ({why})", cause)


async def read_port_line(stream: asyncio.StreamReader) -> bytes:
    """Bytes up to the first newline, the end of the stream, or PORT_LINE_MAX_BYTES + 1."""
    data = b""
    while b"\n" not in data and len(data) <= PORT_LINE_MAX_BYTES:
        chunk = await stream.read(PORT_LINE_MAX_BYTES + 1 - len(data))
        if not chunk:
            break
        data += chunk
    return data


def child_argv(host: str, port: int, on_request: bool) -> list[str]:
    """The command of a store's process for this daemon."""
    argv = [sys.executable, "-m", __name__, host, str(port), str(os.getpid())]
    return [*argv, ON_REQUEST] if on_request else argv


def _child_env() -> dict[str, str]:
    """The daemon's environment without its own `FTD_*` variables (the interpreter may need
    the rest: LD_LIBRARY_PATH, a module system's), where Python finds ftd and ftd_client first."""
    roots = [str(Path(m.__file__ or "").parents[1]) for m in (ftd, ftd_client)]
    env = {name: value for name, value in os.environ.items() if not name.startswith("FTD_")}
    paths = [*roots, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    return {**env, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


class StoreProcess:
    """One store in its own process: `await StoreProcess.start(...)`, its `port` once it
    listens (`listen()` for one started on request), and `close()`: killed and reaped."""

    def __init__(self, proc: asyncio.subprocess.Process, refusals: Refusals) -> None:
        self._proc = proc
        self._refusals = refusals
        self.port = 0
        """0 until the process listens."""

    @property
    def pid(self) -> int:
        return self._proc.pid

    @classmethod
    async def start(
        cls,
        host: str,
        port: int,
        refusals: Refusals,
        on_request: bool = False,
        argv: Sequence[str] | None = None,
    ) -> StoreProcess:
        """A store's process, listening unless `on_request`. StoreProcessError when it does
        not come to listen (it is killed then); `argv`: another command (tests)."""
        command = list(argv) if argv is not None else child_argv(host, port, on_request)
        proc = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=_child_env(),
            start_new_session=True,  # an operator's Ctrl-C is the daemon's to handle
        )
        store = cls(proc, refusals)
        if not on_request:
            await store._await_port()
        return store

    async def listen(self) -> int:
        """Ask a process started on request to listen: its port (StoreProcessError)."""
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(b"listen\n")
            await self._proc.stdin.drain()
        except (ConnectionError, RuntimeError):
            pass  # it died: its missing line says so
        await self._await_port()
        return self.port

    async def _await_port(self) -> None:
        assert self._proc.stdout is not None
        try:
            data = await within(read_port_line(self._proc.stdout), START_TIMEOUT_S)
        except TimeoutError:
            data = b"error no line in %d s" % START_TIMEOUT_S + b"\n"
        except BaseException:
            await self.close()
            raise
        said = decode_port_line(data)
        if said.port is None:
            await self.close()
            if said.refusal is not None:
                self._refusals[said.refusal] += 1
            raise StoreProcessError(f"the store's process (pid {self.pid}): {said.why}")
        self.port = said.port

    async def close(self) -> None:
        """Kill the process (its store and every connection with it) and reap it."""
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        if self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
        await self._proc.wait()


# -- the child ---------------------------------------------------------------------------------


def _die_with(daemon: int) -> None:
    """SIGKILL when the daemon's thread that started us dies; gone now if it already did."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != daemon:
        os._exit(0)


def _say(line: str) -> None:
    os.write(sys.stdout.fileno(), line.encode() + b"\n")


async def _serve(host: str, port: int) -> int:
    try:
        store = await TcpStoreServer.start(host, port)
        # A connection per rank of the job: as many as this process's descriptors allow (it
        # raised its limit to the hard one), a few kept for its pipes, its logs, its listener.
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY:
            store.max_connections = max(MAX_CONNECTIONS, soft - SPARE_DESCRIPTORS)
    except OSError as error:
        _say(f"error {escape(str(error).splitlines()[0] if str(error) else repr(error), 200)}")
        return 1
    _say(str(store.port))
    loop = asyncio.get_running_loop()
    closed: asyncio.Future[None] = loop.create_future()

    class StdinWatch(asyncio.Protocol):
        def connection_lost(self, exc: Exception | None) -> None:
            if not closed.done():
                closed.set_result(None)

    await loop.connect_read_pipe(StdinWatch, sys.stdin)
    await closed
    await store.close()
    return 0


def main(argv: Sequence[str]) -> int:
    host, port, daemon = argv[0], int(argv[1]), int(argv[2])
    _die_with(daemon)
    handler = logging.StreamHandler()
    handler.setFormatter(EscapingFormatter("ftd workers' store (pid %(process)d): %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):  # a connection per rank of the job
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if ON_REQUEST in argv[3:] and not sys.stdin.buffer.readline():
        return 0  # the daemon closed our stdin before asking: no store wanted
    import uvloop

    return uvloop.run(_serve(host, port))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
