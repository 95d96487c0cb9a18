"""Interrupting the training function's thread from the watcher thread.

Two ways, both needed (measured on CPython 3.11, torch 2.13):
- `PyThreadState_SetAsyncExc` schedules RestartInterrupt in the target thread; it is raised at
  the next bytecode boundary, so a thread blocked in a C call (a gloo collective) receives it
  as soon as the call returns (when a peer's abort releases it);
- `signal.pthread_kill(main, signal)` with a Python handler that raises: a blocking system
  call (time.sleep, a read) returns EINTR and the handler runs at once. Only for the main
  thread, where Python runs signal handlers.
Neither reaches a thread busy in C code that holds the GIL: the daemon's hard timeout does.

Either fires only while the function runs ("armed"); disarming clears an exception that was
scheduled but not yet raised, so none escapes into the Wrapper's own recovery code.
"""

from __future__ import annotations

import ctypes
import signal
import threading
from types import FrameType

from ftd_client.inprocess.exceptions import RestartInterrupt

DEFAULT_SIGNAL: int | None = int(signal.SIGRTMIN) + 5 if hasattr(signal, "SIGRTMIN") else None
"""A real-time signal nobody else uses (ftd_client.faults takes SIGRTMIN+3 and +4)."""

# Own prototypes rather than argtypes on ctypes.pythonapi's shared function objects.
_set_async_exc = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.py_object)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi)
)
_clear_async_exc = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi)
)


class Interrupter:
    """Raises RestartInterrupt in the thread that created it, only while armed."""

    def __init__(self, signum: int | None = DEFAULT_SIGNAL) -> None:
        self._lock = threading.Lock()
        self._armed = False
        self._requested = False
        self._target = threading.get_ident()
        on_main = threading.current_thread() is threading.main_thread()
        self._signum = signum if on_main else None
        self._previous: object = None

    def install(self) -> None:
        if self._signum is not None:
            self._previous = signal.signal(self._signum, self._on_signal)

    def restore(self) -> None:
        if self._signum is not None:
            signal.signal(self._signum, self._previous)  # type: ignore[arg-type]

    def arm(self) -> None:
        with self._lock:
            self._armed, self._requested = True, False

    def disarm(self) -> None:
        """Idempotent; may itself be interrupted once (the caller retries)."""
        with self._lock:
            self._armed = False
            _clear_async_exc(self._target, None)

    def interrupt(self) -> bool:
        """From another thread: interrupt the target if it runs the function; whether it did."""
        with self._lock:
            if not self._armed or self._requested:
                return False
            self._requested = True
            _set_async_exc(self._target, RestartInterrupt)
            if self._signum is not None:
                signal.pthread_kill(self._target, self._signum)
            return True

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._armed and self._requested:
            raise RestartInterrupt(f"interrupted by signal {signum}")
