"""Host time between optimizer steps (data loading, host-side work), observed without the
script's help (ftd_client/_progress_torch.py): real torch in this process with sleeps where a
slow data loader would wait, the bookkeeping alone on a fake clock, and the field on the wire."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ftd_client import _progress_torch, protocol, wire
from ftd_client._progress_torch import (
    FORWARD_WINDOW,
    LEARN_STEPS,
    Counters,
    TorchHooks,
    _counted,
    _timed_forward,
)
from ftd_client.messages import ProgressReport
from ftd_client.progress import Observer
from ftd_client.protocol import ProtocolError
from hypothesis import given
from hypothesis import strategies as st

from tests.client.test_progress import mlp, world  # noqa: F401  (world: the fixture)
from tests.support.wire import read

LOADING_S = 0.05
"""What a slow batch costs: far above a step of the tiny model, small enough for many steps."""


def train(model: torch.nn.Module, steps: int, between: Callable[[], object]) -> None:
    """`steps` optimizer steps, `between` run after each step, before the next forward."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 2)).backward()
        optimizer.step()
        between()


def test_host_time_is_the_wait_between_a_step_and_the_next_forward(observer: Observer) -> None:
    model = mlp()
    train(model, LEARN_STEPS + 4, lambda: time.sleep(LOADING_S))  # learning, then wrapped
    model(torch.randn(4, 8))  # the last sleep's forward
    record = observer.sample()
    assert record.host_median_s is not None
    assert LOADING_S <= record.host_median_s < LOADING_S + 2.0, record
    assert len(observer.counters.host_window) == LEARN_STEPS + 4  # one per step
    assert (record.message().host_us or 0) >= LOADING_S * 1e6
    assert record.forward_median_s is not None and record.forward_median_s < LOADING_S


@pytest.mark.usefixtures("world")
def test_time_inside_a_collective_is_not_host_time(observer: Observer) -> None:
    waiting_s = 1.0
    collective = _counted(observer.counters, lambda: time.sleep(waiting_s))  # a slow allreduce
    model = mlp()
    train(model, LEARN_STEPS + 1, lambda: None)
    observer.counters.host_window.clear()

    def load_and_wait() -> None:
        time.sleep(LOADING_S)
        collective()
        dist.barrier()  # a real one, wrapped by the observer: its time is subtracted too

    train(model, 1, load_and_wait)
    model(torch.randn(4, 8))
    assert len(observer.counters.host_window) == 2  # before the step, and after it
    host_ns = observer.counters.host_window[-1]
    assert LOADING_S * 1e9 <= host_ns < (waiting_s - 0.2) * 1e9, host_ns
    assert observer.counters.collective_ns >= waiting_s * 1e9
    assert (observer.counters.called, observer.counters.returned) == (2, 2)


def test_no_host_time_until_a_forward_follows_a_step(observer: Observer) -> None:
    model = mlp()
    model(torch.randn(4, 8))  # a forward with no step before it
    assert observer.sample().message().host_us is None
    train(model, 1, lambda: None)
    assert observer.sample().message().host_us is None  # a step, no forward after it yet
    with torch.no_grad():
        model(torch.randn(4, 8))  # evaluation: not the training forward that ends the wait
    assert observer.sample().message().host_us is None
    model(torch.randn(4, 8))
    assert (observer.sample().message().host_us or -1) >= 0


def test_only_a_steps_first_forward_ends_its_host_time(observer: Observer) -> None:
    """Gradient accumulation: the micro-batches after a step's first are not its host time."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(LEARN_STEPS + 3):
        for _ in range(4):
            model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    assert len(observer.counters.host_window) == LEARN_STEPS + 2


class NsClock:
    """CLOCK_MONOTONIC in ns that moves only when told."""

    def __init__(self) -> None:
        self.ns = 10**15

    def __call__(self) -> int:
        return self.ns


events = st.lists(
    st.tuples(st.sampled_from(["step", "idle", "collective", "forward"]), st.integers(0, 10**10)),
    max_size=60,
)


@given(events)
def test_host_time_is_the_gap_less_collectives_on_a_fake_clock(
    script: list[tuple[str, int]],
) -> None:
    """Any order of steps, idle time, collectives and forwards: each step's first forward
    appends exactly the idle time since that step (collectives excluded), and nothing else."""
    clock = NsClock()
    fake_time = SimpleNamespace(monotonic_ns=clock)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_progress_torch, "time", fake_time)
        counters = Counters()
        hooks = TorchHooks(counters)

        def advance(duration_ns: int) -> Callable[..., None]:
            def run(*args: Any) -> None:
                clock.ns += duration_ns

            return run

        expected: list[int] = []
        idle: int | None = None  # since the last step, while no forward began
        for kind, duration_ns in script:
            if kind == "step":
                hooks._on_step(None, (), {})
                idle = 0
            elif kind == "idle":
                clock.ns += duration_ns
                idle = None if idle is None else idle + duration_ns
            elif kind == "collective":
                _counted(counters, advance(duration_ns))()
            else:
                _timed_forward(counters, advance(duration_ns), lambda: True)(None)
                if idle is not None:
                    expected.append(idle)
                idle = None
    assert list(counters.host_window) == expected[-FORWARD_WINDOW:]
    assert counters.depth == 0


@pytest.mark.parametrize("value", [-1, 1.5, 2**60, True, "1000", [1], {"us": 1}])
def test_host_time_on_the_wire_is_refused_as_forward_time_is(value: object) -> None:
    counts = {"t": protocol.PROGRESS, "steps": 3, "called": 0, "returned": 0}
    causes = []
    for field in ("fwd_us", "host_us"):
        with pytest.raises(ProtocolError) as refused:
            read({**counts, field: value})
        causes.append(refused.value.cause)
    assert causes == ["bad_progress", "bad_progress"]


def test_host_time_on_the_wire_is_accepted() -> None:
    record = Observer(lambda record: None).sample()
    assert record.message().host_us is None  # no step yet: absent
    sampled = replace(record, forward_median_s=0.0123, host_median_s=0.0805)
    message = wire.decode(wire.encode(sampled.message())).message
    assert isinstance(message, ProgressReport)
    assert (message.fwd_us, message.host_us) == (12300, 80500)
    largest = replace(record.message(), host_us=protocol.MAX_SEQUENCE)
    assert wire.decode(wire.encode(largest)).message == largest
