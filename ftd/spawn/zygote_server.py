"""The zygote process: torch imported once, ranks forked from it on request.

Run by the daemon as `python -u -m ftd.spawn.zygote_server <socket fd> <preload,...>`. It
imports the preload modules and then does nothing else: no threads, no CUDA, no store. It
answers requests on an AF_UNIX SOCK_SEQPACKET socket, one JSON message per packet:

    zygote -> daemon, once:  {"ready": true, "pid": P, "seconds": S, "problem": null | "..."}
                             {"ready": false, "error": "<traceback of the failed preload>"}
    daemon -> zygote:        {"argv": [...], "env": {...}, ...} + SCM_RIGHTS [stdin, stdout, stderr]
    zygote -> daemon:        {"pid": R} | {"error": "..."}

A rank is forked through a short-lived intermediate: zygote -> intermediate -> rank, and the
intermediate exits at once. The rank is then re-parented to its nearest subreaper ancestor,
the daemon (the zygote is not one), so the daemon waits for it like for any child of its own.
The zygote answers only once the intermediate is gone, so the pid it sends is already the
daemon's child, and it already leads its own session. EOF on the socket (the daemon exited,
however it exited) ends the zygote.

This module and `rank_main` use the standard library only: whatever they import, every rank
carries in `sys.modules`.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import signal
import socket
import struct
import sys
import time
import traceback
from typing import Any

MAX_MESSAGE = 1 << 20
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
    sock.send(json.dumps(message).encode())


def _preload(modules: list[str]) -> None:
    import importlib

    for name in modules:
        importlib.import_module(name)


def _fork_rank(request: dict[str, Any], sock: socket.socket) -> int | None:
    """The rank's pid in the zygote; None in the rank itself (which then returns to run)."""
    expected_parent = os.getppid()  # the daemon: the rank's subreaper once re-parented
    pid_r, pid_w = os.pipe()
    intermediate = os.fork()
    if intermediate == 0:
        os.close(pid_r)
        sock.close()
        request["_intermediate"] = _intermediate(pid_w)
        request["_parent"] = expected_parent
        return None
    os.close(pid_w)
    data = b""
    with os.fdopen(pid_r, "rb") as reader:
        data = reader.read()  # until EOF: the intermediate exited
    _, status = os.waitpid(intermediate, 0)
    if len(data) != struct.calcsize(PID_FORMAT) or status != 0:
        raise RuntimeError(f"the intermediate process failed (wait status {status})")
    rank_pid: int = struct.unpack(PID_FORMAT, data)[0]
    return rank_pid


def _intermediate(pid_w: int) -> int:
    """In the intermediate: fork the rank and exit once it leads its own session. Returns only
    in the rank: the intermediate's pid."""
    me = os.getpid()
    try:
        ready_r, ready_w = os.pipe()
        rank = os.fork()
        if rank == 0:
            os.close(ready_r)
            os.close(pid_w)
            os.setsid()  # before the daemon learns the pid: killpg(pid) must reach it at once
            os.close(ready_w)
            return me
        os.close(ready_w)
        os.read(ready_r, 1)  # EOF once the rank called setsid (or died)
        os.write(pid_w, struct.pack(PID_FORMAT, rank))
        code = 0
    except BaseException:
        code = 1
    os._exit(code)


def serve(sock: socket.socket) -> dict[str, Any] | None:
    """Answer spawn requests until EOF; returns a request only in a freshly forked rank."""
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 3)
        except InterruptedError:
            continue
        if not message:
            for fd in fds:
                os.close(fd)
            return None
        try:
            request: dict[str, Any] = json.loads(message)
            if len(fds) != 3:
                raise ValueError(f"expected 3 file descriptors, got {len(fds)}")
            problem = unsafe_state()
            if problem is not None:
                _send(sock, {"error": problem, "unsafe": True})
                continue
            request["_fds"] = fds
            pid = _fork_rank(request, sock)
            if pid is None:
                return request  # the rank: fds are its stdio
            _send(sock, {"pid": pid})
        except Exception as error:
            _send(sock, {"error": f"{type(error).__name__}: {error}"})
        finally:
            if os.getpid() == ZYGOTE_PID:
                for fd in fds:
                    os.close(fd)


def main(argv: list[str]) -> dict[str, Any] | None:
    fd, preload = int(argv[0]), [m for m in argv[1].split(",") if m]
    # Ctrl-C in a terminal is the daemon's to handle; the zygote ends on EOF (or SIGTERM).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)  # ranks must reach the daemon, not us
    sock = socket.socket(fileno=fd)
    started = time.monotonic()
    try:
        _preload(preload)
    except BaseException:
        _send(sock, {"ready": False, "error": traceback.format_exc()})
        return None
    # Preloaded objects live as long as the zygote: keep the collector off their pages, so
    # forked ranks share them instead of copying them on the first collection.
    gc.collect()
    gc.freeze()
    _send(
        sock,
        {
            "ready": True,
            "pid": os.getpid(),
            "seconds": time.monotonic() - started,
            "problem": unsafe_state(),
        },
    )
    return serve(sock)


if __name__ == "__main__":
    from ftd.spawn import rank_main

    rank_main.INITIAL_PATH0 = sys.path[0] if sys.path else None
    _request = main(sys.argv[1:])
    if _request is not None:
        # In a forked rank: become the rank, unwinding nothing of the zygote's. The script
        # returns here and the interpreter then exits as it would after `python script.py`.
        rank_main.become_rank(_request)
