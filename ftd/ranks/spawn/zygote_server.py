"""The zygote process: torch imported once, ranks forked from it on request.

Run by the daemon as `python -u -m ftd.ranks.spawn.zygote_server <socket fd> <preload,...>
<warm,...> <warm after s>`. It imports the preload modules and then does nothing else (no
threads, no CUDA, no store) but import the warm modules once its first ranks ran a while. It
answers requests on an AF_UNIX SOCK_SEQPACKET socket, one JSON message per packet:

    zygote -> daemon, once:  {"ready": true, "pid": P, "seconds": S, "problem": null | "..."}
                             {"ready": false, "error": "<traceback of the failed preload>"}
    daemon -> zygote:        {"common": {"argv": [...], "env": {...}, "cwd": "...", ...},
                              "envs": [{each rank's own variables}, ...]}
                             + SCM_RIGHTS [stdin, stdout, stderr] of each rank in turn
    zygote -> daemon:        {"pids": [R, ...]} | {"error": "...", "pids": [forked anyway]}
    zygote -> daemon, once it forked ranks and then was idle <warm after> s (unasked):
                             {"warming": [module, ...]}, then {"warmed": [...], "seconds": S,
                              "failed": ["<module>: <error>", ...], "problem": null | "..."}

An attempt's ranks are forked through one short-lived intermediate: zygote -> intermediate ->
ranks, and the intermediate exits once they are forked. Each rank is then re-parented to its
nearest subreaper ancestor, the daemon (the zygote is not one), so the daemon waits for it like
for any child of its own. The zygote answers only once the intermediate is gone, so the pids it
sends are already the daemon's children, each leading its own session. EOF on the socket (the
daemon exited, however it exited) ends the zygote.

This module and `rank_main` use the standard library only: whatever they import, every rank
carries in `sys.modules`.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import select
import signal
import socket
import struct
import sys
import time
import traceback
from typing import Any

from ftd.text import is_decimal

MAX_MESSAGE = 1 << 22
MAX_RANKS_PER_REQUEST = 64
MAX_FDS = 3 * MAX_RANKS_PER_REQUEST  # three stdio fds per rank, under the kernel's SCM_MAX_FD
NOFILE_ENV = "FTD_NOFILE_SOFT"
"""The descriptor limit the daemon was started with (set by the daemon for its zygote)."""
PR_SET_CHILD_SUBREAPER = 36
PID_FORMAT = "=q"
ZYGOTE_PID = os.getpid()


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def unsafe_state() -> str | None:
    """Why forking this process now would hand a rank a broken state, or None."""
    threads = thread_count()
    if threads != 1:
        return (
            f"the zygote holds {threads - 1} thread(s) besides its main thread (started by a "
            "preloaded module?); a process forked while another thread holds a lock can deadlock"
        )
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return "CUDA was initialised in the zygote; a forked child cannot use it"
    return None


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    try:
        sock.send(json.dumps(message).encode())
    except (BrokenPipeError, ConnectionResetError):
        # The daemon is gone (it may have failed its own start-up): nobody is left to serve.
        os._exit(0)


RANK_START_MODULES = ("ftd_client.rank_start", "ftd_client.progress_link")
"""What each rank's start (rank_main: progress observation) imports: 25-60 ms a rank on two
busy cores, most of a forked rank's start to its script's `main`, paid once in the zygote
instead (issue 41). Importing them starts no thread and hooks nothing."""


def _preload(modules: list[str]) -> None:
    import importlib

    for name in modules:
        importlib.import_module(name)


def _warm(sock: socket.socket, modules: list[str]) -> None:
    """Import what the ranks would otherwise each import again after every restart (DDP's
    constructor imports torch._dynamo: 2.5 s on two busy cores). A module that fails is skipped:
    the ranks import it themselves, as without warming."""
    import importlib

    _send(sock, {"warming": modules})
    started, failed = time.monotonic(), []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as error:
            failed.append(f"{name}: {type(error).__name__}: {error}")
    gc.collect()
    gc.freeze()
    seconds, problem = time.monotonic() - started, unsafe_state()
    _send(sock, {"warmed": modules, "seconds": seconds, "failed": failed, "problem": problem})


def _fork_ranks(
    ranks: list[dict[str, Any]], sock: socket.socket
) -> tuple[list[int], str | None] | dict[str, Any]:
    """In the zygote: (the ranks' pids, an error or None). In a new rank: its request."""
    expected_parent = os.getppid()  # the daemon: the ranks' subreaper once re-parented
    pid_r, pid_w = os.pipe()
    intermediate = os.fork()
    if intermediate == 0:
        os.close(pid_r)
        sock.close()
        index, me = _intermediate(pid_w, len(ranks))
        for other in ranks:  # the other ranks' stdio is not this rank's business
            if other is not ranks[index]:
                for fd in other["_fds"]:
                    os.close(fd)
        request = ranks[index]
        request["_intermediate"], request["_parent"] = me, expected_parent
        return request
    os.close(pid_w)
    with os.fdopen(pid_r, "rb") as reader:
        data = reader.read()  # until EOF: the intermediate exited
    _, status = os.waitpid(intermediate, 0)
    size = struct.calcsize(PID_FORMAT)
    pids = [struct.unpack_from(PID_FORMAT, data, i)[0] for i in range(0, len(data), size)]
    if len(pids) != len(ranks) or status != 0:
        return pids, f"the intermediate process failed (wait status {status})"
    return pids, None


def _intermediate(pid_w: int, count: int) -> tuple[int, int]:
    """In the intermediate: fork the ranks one by one and exit once each leads its own
    session. Returns only in a rank: (its index, the intermediate's pid)."""
    me = os.getpid()
    code = 0
    try:
        for index in range(count):
            ready_r, ready_w = os.pipe()
            rank = os.fork()
            if rank == 0:
                os.close(ready_r)
                os.close(pid_w)
                os.setsid()  # before the daemon learns the pid: killpg(pid) reaches it at once
                os.close(ready_w)
                return index, me
            os.close(ready_w)
            os.read(ready_r, 1)  # EOF once the rank called setsid (or died)
            os.close(ready_r)
            os.write(pid_w, struct.pack(PID_FORMAT, rank))
    except BaseException:
        code = 1
    os._exit(code)


def serve(
    sock: socket.socket, warm: list[str] | None = None, warm_after_s: float = 30.0
) -> dict[str, Any] | None:
    """Answer spawn requests until EOF; returns a request only in a freshly forked rank. Once
    ranks were forked and nothing was asked for `warm_after_s`, import `warm` (once)."""
    to_warm, forked_once = list(warm or ()), False
    while True:
        if to_warm and forked_once and not select.select([sock], [], [], warm_after_s)[0]:
            _warm(sock, to_warm)
            to_warm = []
            continue
        try:
            message, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
        except InterruptedError:
            continue
        except OSError:  # the daemon is gone (reset, closed): nothing more to serve
            return None
        if not message:
            for fd in fds:
                os.close(fd)
            return None
        try:
            batch = json.loads(message)
            common: dict[str, Any] = batch["common"]
            ranks: list[dict[str, Any]] = [
                {**common, "env": {**common["env"], **own}, "own_env": sorted(own)}
                for own in batch["envs"]
            ]
            if len(fds) != 3 * len(ranks):
                raise ValueError(f"expected {3 * len(ranks)} file descriptors, got {len(fds)}")
            problem = unsafe_state()
            if problem is not None:
                _send(sock, {"error": problem, "unsafe": True})
                continue
            for index, rank in enumerate(ranks):
                rank["_fds"] = fds[3 * index : 3 * index + 3]
            forked = _fork_ranks(ranks, sock)
            if isinstance(forked, dict):
                return forked  # a rank: its stdio fds are in the request
            pids, error = forked
            forked_once = True
            _send(sock, {"pids": pids} if error is None else {"pids": pids, "error": error})
        except Exception as error:
            _send(sock, {"error": f"{type(error).__name__}: {error}"})
        finally:
            if os.getpid() == ZYGOTE_PID:
                for fd in fds:
                    os.close(fd)


def _restore_descriptor_limit() -> None:
    """The daemon raised its own descriptor limit; ranks get the one it was started with (a
    program using select() breaks on descriptors above 1024)."""
    import resource

    soft = os.environ.pop(NOFILE_ENV, "")
    if is_decimal(soft):
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(int(soft), hard), hard))


def main(argv: list[str]) -> dict[str, Any] | None:
    fd, preload = int(argv[0]), [m for m in argv[1].split(",") if m]
    warm = [m for m in argv[2].split(",") if m.strip()] if len(argv) > 4 else []
    warm_after_s = int(argv[3]) if len(argv) > 4 and is_decimal(argv[3]) else 30
    # Ctrl-C in a terminal is the daemon's to handle; the zygote ends on EOF (or SIGTERM).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)  # ranks must reach the daemon, not us
    _restore_descriptor_limit()
    sock = socket.socket(fileno=fd)
    started = time.monotonic()
    try:
        _preload(preload)
    except BaseException:
        _send(sock, {"ready": False, "error": traceback.format_exc()})
        return None
    with contextlib.suppress(Exception):  # else each rank imports them itself, as before
        _preload(list(RANK_START_MODULES))
    # Preloaded objects live as long as the zygote: keep the collector off their pages, so
    # forked ranks share them instead of copying them on the first collection.
    gc.collect()
    gc.freeze()
    ready = {
        "ready": True,
        "pid": os.getpid(),
        "seconds": time.monotonic() - started,
        "problem": unsafe_state(),
    }
    try:
        _send(sock, ready)
    except OSError:  # the daemon left while this zygote preloaded
        return None
    return serve(sock, warm, warm_after_s)


if __name__ == "__main__":
    from ftd.ranks.spawn import rank_main

    rank_main.INITIAL_PATH0 = sys.path[0] if sys.path else None
    rank_main.INHERITED_SIGNALS = rank_main.inherited_signals()
    _request = main(sys.argv[1:])
    if _request is not None:
        rank_main.become_rank(_request)  # in a forked rank: never returns
