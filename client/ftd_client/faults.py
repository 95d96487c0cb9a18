"""Simulated faults, carried out inside the target rank so detection and recovery are real.

Two ways in, both only when the daemon asked for them:
- `--ft-param-simulated_fault`: the daemon arms one rank of the first attempt with
  `FTD_SIMULATED_FAULT=<kind>:<delay seconds>`; a background thread waits, then fires.
- `POST /v1/faults` (daemon started with --enable-fault-injection, so ranks get
  FTD_FAULT_INJECTION=1): the daemon sends KILL_SIGNAL or HANG_SIGNAL to the rank.
Either way the rank first tells the daemon (with the sections open at that moment), then
SIGKILLs itself (`kill`) or makes its main thread hang in a signal handler that never returns
(`hang`), so heartbeats stop as they would in a real hang.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from collections.abc import Callable

# Real-time signals nobody else uses.
HANG_SIGNAL: int | None = int(signal.SIGRTMIN) + 3 if hasattr(signal, "SIGRTMIN") else None
KILL_SIGNAL: int | None = int(signal.SIGRTMIN) + 4 if hasattr(signal, "SIGRTMIN") else None
KINDS = ("kill", "hang")


def parse(spec: str) -> tuple[str, float]:
    kind, _, delay = spec.partition(":")
    if kind not in KINDS:
        raise ValueError(f"unknown simulated fault kind {kind!r}")
    return kind, float(delay)


def arm_from_env(announce: Callable[[str], None]) -> threading.Thread | None:
    """Install what the daemon asked for through the environment (main thread only)."""
    on_request = os.environ.get("FTD_FAULT_INJECTION") == "1"
    spec = os.environ.get("FTD_SIMULATED_FAULT")
    if not on_request and not spec:
        return None
    if HANG_SIGNAL is None or KILL_SIGNAL is None:
        return None
    if threading.current_thread() is not threading.main_thread():
        warnings.warn("ftd: fault injection needs RankClient() on the main thread", stacklevel=3)
        return None
    signal.signal(HANG_SIGNAL, lambda signum, frame: _hang_forever(announce))
    signal.signal(KILL_SIGNAL, lambda signum, frame: _kill_now(announce))
    if not spec:
        return None
    kind, delay_s = parse(spec)
    thread = threading.Thread(
        target=_fire,
        args=(kind, delay_s, threading.main_thread().ident),
        name="ftd-fault",
        daemon=True,
    )
    thread.start()
    return thread


def _fire(kind: str, delay_s: float, main: int | None) -> None:
    time.sleep(delay_s)
    signal_number = KILL_SIGNAL if kind == "kill" else HANG_SIGNAL
    if main is not None and signal_number is not None:
        signal.pthread_kill(main, signal_number)


def _kill_now(announce: Callable[[str], None]) -> None:
    announce("kill")
    os.kill(os.getpid(), signal.SIGKILL)


def _hang_forever(announce: Callable[[str], None]) -> None:
    announce("hang")
    while True:
        time.sleep(3600)
