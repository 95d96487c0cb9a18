"""Progress observed from inside a rank, with no change to the script.

`install(send)` runs in a rank before the script: it hooks torch (once the script imports it;
this module never imports torch itself, see _import_watch) so that optimizer steps, Python
collective calls, the outermost forward's time, the host time between a step and the next
forward (data loading) and long phases (`torch.save`, checkpoints, DataLoader iterator
creation) advance counters (_progress_torch), and starts a daemon thread, `ftd-progress`, that
every `interval_s` samples them and calls `send(record)` with a `Progress` when something
changed, or every `keepalive_s` when nothing did.

The collectives a rank has entered are c10d's own count for the default group, read by the
sampler: it includes those DDP's reducer issues from C++, and it is readable while the main
thread is blocked inside a collective (gloo waits without the GIL). Of ranks stuck in one job,
the rank whose count is lowest has not entered the collective the others wait in: the culprit.

The sampler never raises into the program: an error in sampling or in `send` is counted
(`Observer.failures`) and the next interval tries again. `Progress.message()` is the record on
the wire (messages.ProgressReport, read by wire.decode):

| field | meaning |
|---|---|
| `m` | int ns: the rank's CLOCK_MONOTONIC when sampled |
| `steps` | int: optimizer steps since install |
| `age_ms` | int: ms since the last optimizer step (absent before the first) |
| `entered` | int: collectives entered on the default group (absent without one) |
| `called`, `returned` | int: torch.distributed collective calls entered and returned |
| `fwd_us` | int: median outermost forward time per optimizer step, last 16 steps |
| `host_us` | int: median host time before a step's first forward (data loading), last 16 steps |
| `auto` | object: automatic section open -> ms it has been open |
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ftd_client import _import_watch
from ftd_client._progress_torch import Counters, TorchHooks, register_fork_reset
from ftd_client.messages import ProgressReport
from ftd_client.rank_setup import keep_stack_signal_off_this_thread

log = logging.getLogger("ftd_client")

DEFAULT_INTERVAL_S = 0.5
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.05, 10.0
DEFAULT_KEEPALIVE_S = 5.0
THREAD_NAME = "ftd-progress"


@dataclass(frozen=True)
class Progress:
    """One sample of a rank's progress (see the module's docstring for the wire form)."""

    sampled_ns: int
    steps: int
    last_step_age_s: float | None
    collectives_entered: int | None
    collectives_called: int
    collectives_returned: int
    forward_median_s: float | None
    auto_sections: tuple[tuple[str, float], ...]
    """(name, seconds open), oldest first."""
    host_median_s: float | None = None
    """Median host time from a step's end to the next step's first timed forward, less the
    collective calls in it (_progress_torch), last 16 steps."""

    def same_progress(self, other: Progress | None) -> bool:
        """Nothing advanced, opened or closed since `other` (ages and times aside)."""
        return other is not None and (
            self.steps,
            self.collectives_entered,
            self.collectives_called,
            self.collectives_returned,
            tuple(name for name, _ in self.auto_sections),
        ) == (
            other.steps,
            other.collectives_entered,
            other.collectives_called,
            other.collectives_returned,
            tuple(name for name, _ in other.auto_sections),
        )

    def message(self, stack_signal: int | None = None) -> ProgressReport:
        """This record as the rank sends it (its sample time travels beside: `sampled_ns`)."""
        return ProgressReport(
            self.steps,
            self.collectives_called,
            self.collectives_returned,
            None if self.last_step_age_s is None else round(self.last_step_age_s * 1000),
            self.collectives_entered,
            None if self.forward_median_s is None else round(self.forward_median_s * 1e6),
            None if self.host_median_s is None else round(self.host_median_s * 1e6),
            tuple((name, round(age * 1000)) for name, age in self.auto_sections),
            stack_signal,
        )


class Observer:
    """The counters, the hooks that advance them and the sampler that reports them."""

    def __init__(
        self,
        send: Callable[[Progress], object],
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.send = send
        self.interval_s = min(max(interval_s, MIN_INTERVAL_S), MAX_INTERVAL_S)
        self.keepalive_s = max(keepalive_s, self.interval_s)
        self.clock_ns = clock_ns
        self.counters = Counters()
        self.hooks = TorchHooks(self.counters)
        self.failures = 0
        """Samples or sends that raised (contained; the next interval tries again)."""
        self.sent = 0
        self._last: Progress | None = None
        self._last_sent_ns = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self, now_ns: int | None = None) -> Progress:
        counters = self.counters
        now = self.clock_ns() if now_ns is None else now_ns
        last_step = counters.last_step_ns
        window = tuple(counters.forward_window)
        host_window = tuple(counters.host_window)
        with counters.auto_lock:
            auto = tuple(counters.auto)
        return Progress(
            sampled_ns=now,
            steps=counters.steps,
            last_step_age_s=max(now - last_step, 0) / 1e9 if last_step else None,
            collectives_entered=_entered(),
            collectives_called=counters.called,
            collectives_returned=counters.returned,
            forward_median_s=statistics.median(window) / 1e9 if window else None,
            auto_sections=tuple((name, max(now - opened, 0) / 1e9) for name, opened in auto),
            host_median_s=statistics.median(host_window) / 1e9 if host_window else None,
        )

    def tick(self, now_ns: int | None = None) -> Progress | None:
        """Sample; send when something changed or keepalive_s passed. What was sent, if any."""
        try:
            record = self.sample(now_ns)
            due = record.sampled_ns - self._last_sent_ns >= self.keepalive_s * 1e9
            if record.same_progress(self._last) and not due:
                return None
            self._last, self._last_sent_ns = record, record.sampled_ns
            self.send(record)
        except Exception:
            self._last = None  # not delivered: the next interval tries again
            self.failures += 1
            if self.failures == 1:
                log.debug("ftd: progress sample failed", exc_info=True)
            return None
        self.sent += 1
        return record

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        self._thread = None

    def _run(self) -> None:
        keep_stack_signal_off_this_thread()
        while not self._stop.wait(self.interval_s):
            self.tick()


def _entered() -> int | None:
    """The default group's count of collectives issued on it, or None without one."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None:
        return None
    with contextlib.suppress(Exception):  # no group yet, or one being destroyed
        if c10d.is_initialized():
            return int(c10d._get_default_group()._get_sequence_number_for_group())
    return None


_observer: Observer | None = None


def install(
    send: Callable[[Progress], object],
    *,
    interval_s: float = DEFAULT_INTERVAL_S,
    keepalive_s: float = DEFAULT_KEEPALIVE_S,
    start: bool = True,
) -> Observer:
    """Observe this process's progress and report it through `send` (once per process: a
    second call returns the first observer). torch is hooked now if imported, else right after
    the script imports it; with `start=False` the caller drives `Observer.tick` itself."""
    global _observer
    if _observer is not None:
        return _observer
    observer = _observer = Observer(send, interval_s=interval_s, keepalive_s=keepalive_s)
    register_fork_reset(observer.counters)
    _import_watch.when_imported("torch", observer.hooks.on_torch)
    _import_watch.when_imported("torch.distributed.checkpoint", observer.hooks.on_checkpoint)
    if start:
        observer.start()
    return observer


def uninstall() -> None:
    """Stop the sampler and put torch back as it was (tests; a rank never needs it)."""
    global _observer
    observer, _observer = _observer, None
    _import_watch.forget()
    if observer is not None:
        observer.stop()
        observer.hooks.remove()
