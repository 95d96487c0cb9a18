"""Containment: an error inside one part of the daemon ends at that part's boundary.

Every boundary (a rank message's handling, the monitor's timers, a hang's kill, learning,
the failure summary, persistence, the event journal, a metrics scrape, the attempt loop) runs
its part through `call(component, work)`: an unexpected exception is logged once per component
and exception type with its origin, counted (`ftd_internal_errors_total{component}`), and the
boundary decides what follows: an input is dropped, a decision falls back to what was in
force, and an attempt that cannot go on fails with "internal error in <component>: <error>",
to which the restart policy applies as to any failure. `ftd serve` never ends with a
traceback of its own.

A test hook proves it: FTD_INTERNAL_FAULT=<component>[:N][,...] in the daemon's environment
makes `call(component, ...)` (and each boundary's `inject`) raise InjectedFault in its first N
runs (1 by default). FTD_INTERNAL_DELAY=<component>:<ms>[,...] makes each of them first block
the daemon for that long: a slow part, which the performance budget must catch
(tests/bench/test_budget.py).
"""

from __future__ import annotations

import collections
import logging
import os
import time
import traceback
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from ftd.text import is_decimal

log = logging.getLogger("ftd.containment")
P = ParamSpec("P")
T = TypeVar("T")

FAULT_ENV = "FTD_INTERNAL_FAULT"
DELAY_ENV = "FTD_INTERNAL_DELAY"
COMPONENTS = frozenset(
    {
        "rank_messages",
        "monitor",
        "stragglers",
        "hangs",
        "learning",
        "summary",
        "persistence",
        "events",
        "metrics",
        "attempt",
    }
)

errors: collections.Counter[str] = collections.Counter()
"""Internal errors by component since the daemon started."""
_said: set[tuple[str, str]] = set()


class InjectedFault(RuntimeError):
    """Raised by the FTD_INTERNAL_FAULT test hook."""


def _injected() -> dict[str, int]:
    faults: dict[str, int] = {}
    for item in os.environ.get(FAULT_ENV, "").split(",")[:32]:
        name, _, count = item.strip().partition(":")
        if name in COMPONENTS:
            faults[name] = int(count) if is_decimal(count) and len(count) < 6 else 1
    return faults


_faults = _injected()


def _delays() -> dict[str, float]:
    """Seconds by component, from DELAY_ENV (at most 99 999 ms each)."""
    delays: dict[str, float] = {}
    for item in os.environ.get(DELAY_ENV, "").split(",")[:32]:
        name, _, ms = item.strip().partition(":")
        if name in COMPONENTS and is_decimal(ms) and len(ms) < 6:
            delays[name] = int(ms) / 1000
    return delays


_delays_s = _delays()


def describe(component: str, error: BaseException) -> str:
    """The one sentence for logs, events and failure reasons."""
    return f"internal error in {component}: {type(error).__name__}: {str(error)[:300]}"


def record(component: str, error: BaseException) -> str:
    """Count `error` of `component` and log it once per kind with where it came from; the
    sentence that says it."""
    errors[component] += 1
    sentence = describe(component, error)
    key = (component, type(error).__name__)
    if key not in _said:
        _said.add(key)
        frames = traceback.extract_tb(error.__traceback__)
        origin = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        log.error("%s%s; supervision goes on (further ones are counted)", sentence, origin)
    return sentence


def inject(component: str) -> None:
    """The test hook's point in `component`."""
    if component in _delays_s:
        time.sleep(_delays_s[component])  # blocking on purpose: the daemon itself is slow
    left = _faults.get(component, 0)
    if left > 0:
        _faults[component] = left - 1
        raise InjectedFault(f"injected by {FAULT_ENV}")


def call(component: str, work: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T | None:
    """Run a part's work: its result, or None when it raised (recorded: logged once,
    counted). A boundary that must do more (fail an attempt) catches and `record`s itself."""
    try:
        inject(component)
        return work(*args, **kwargs)
    except Exception as error:
        record(component, error)
        return None
