"""What every fuzz target shares: its settings, its decoder's name and the per-input CPU budget.

A target is a hypothesis test marked `@fuzz_target("<decoder>", examples)`. With the tests it
runs `examples` inputs (the short pass). The long run (docs/security.md, `make fuzz-long`)
sets FTD_FUZZ_SECONDS: each decoder's targets then run again and again, fresh inputs each
round, until that many seconds have passed for the decoder (shared among its targets); see
`run_for_the_long_pass` in tests/conftest.py.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import pytest
from hypothesis import HealthCheck, settings

F = TypeVar("F", bound=Callable[..., object])

LONG_RUN_S = float(os.environ.get("FTD_FUZZ_SECONDS", "0"))
"""Seconds per decoder in the long run; 0 in the short pass."""
ROUND_EXAMPLES = int(os.environ.get("FTD_FUZZ_EXAMPLES", "0"))
"""Inputs per round when set (the long run's rounds), else each target's own short count."""
BUDGET_S = 0.5
"""CPU seconds one input may cost (thread time: a busy machine does not count)."""


def fuzz_target(decoder: str, examples: int) -> Callable[[F], F]:
    """Mark a hypothesis test as a fuzz target of `decoder`, with `examples` inputs a round."""
    chosen = ROUND_EXAMPLES or examples

    def mark(test: F) -> F:
        tuned = settings(
            max_examples=chosen,
            deadline=None,
            suppress_health_check=[
                HealthCheck.too_slow,
                HealthCheck.data_too_large,
                HealthCheck.function_scoped_fixture,
            ],
        )(test)
        marked: F = pytest.mark.fuzz(decoder=decoder, examples=chosen)(tuned)
        return marked

    return mark


@contextmanager
def budget(seconds: float = BUDGET_S) -> Iterator[None]:
    """Assert that the block costs under `seconds` of this thread's CPU. The cyclic garbage
    collector is paused meanwhile: a full collection of the harness's heap, late in a long run,
    took half a second inside one input that itself cost a millisecond."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        start = time.thread_time()
        yield
        used = time.thread_time() - start
    finally:
        if collecting:
            gc.enable()
    assert used < seconds, f"{used:.3f} s of CPU for one input"
