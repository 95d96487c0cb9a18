"""Simulated faults, carried out inside the target rank so detection and recovery are real.

The daemon arms at most one rank per job (`FTD_SIMULATED_FAULT=<kind>:<delay seconds>`, first
attempt only). After the delay a background thread tells the daemon, then either SIGKILLs this
process (`kill`) or makes the main thread hang (`hang`: a signal whose handler never returns,
so heartbeats stop as they would in a real hang).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from types import FrameType

# A real-time signal nobody else uses: its handler never returns, so the main thread hangs.
HANG_SIGNAL: int | None = int(signal.SIGRTMIN) + 3 if hasattr(signal, "SIGRTMIN") else None
KINDS = ("kill", "hang")


def parse(spec: str) -> tuple[str, float]:
    kind, _, delay = spec.partition(":")
    if kind not in KINDS:
        raise ValueError(f"unknown simulated fault kind {kind!r}")
    return kind, float(delay)


def arm_from_env(announce: Callable[[str], None]) -> threading.Thread | None:
    spec = os.environ.get("FTD_SIMULATED_FAULT")
    if not spec:
        return None
    kind, delay_s = parse(spec)
    if kind == "hang":
        if HANG_SIGNAL is None or threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "ftd: a simulated hang needs RankClient() on the main thread", stacklevel=3
            )
            return None
        signal.signal(HANG_SIGNAL, _hang_forever)
    main = threading.main_thread().ident
    thread = threading.Thread(
        target=_fire, args=(kind, delay_s, announce, main), name="ftd-fault", daemon=True
    )
    thread.start()
    return thread


def _fire(kind: str, delay_s: float, announce: Callable[[str], None], main: int | None) -> None:
    time.sleep(delay_s)
    announce(kind)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif main is not None and HANG_SIGNAL is not None:
        signal.pthread_kill(main, HANG_SIGNAL)


def _hang_forever(signum: int, frame: FrameType | None) -> None:
    while True:
        time.sleep(3600)
