"""The counters a rank's training advances, and the hooks into torch that advance them.

Everything here runs in the script's own threads, on its hot paths, so it only counts: a few
attribute increments and clock reads per event, no lock, no allocation beyond two deque
appends per step; the sampler thread (progress.py) reads the counters. Chosen per signal
(torch 2.13, measured on a 2-vCPU VM; bench/PROGRESS.md):

- Optimizer steps: `torch.optim.optimizer.register_optimizer_step_post_hook`, global, so
  every optimizer the script makes, before or after install, is seen.
- Collectives entered: not counted here at all. c10d numbers every collective issued on a
  group, DDP's reducer's allreduces from C++ included; the sampler reads the default group's
  `_get_sequence_number_for_group()` (0.4 us) instead of anything being wrapped.
- Collectives returned: the `torch.distributed` collective functions (the names the script
  calls) are wrapped to count calls entered and returned, so `entered - returned` says a
  Python-issued call is in progress. Completion of the C++-issued ones (DDP) cannot be had on
  gloo: `_register_on_completion_hook` is NCCL-only and the flight recorder leaves gloo work
  `scheduled`; DDP's single comm hook slot belongs to the script.
- Forward time of the outermost module, with grad enabled (training, not evaluation):
  global module hooks would put every module call of every model on torch's slow path (+30
  us a step for a 5-module MLP, 10 %), so they only learn which classes are called at depth 0
  during the first LEARN_STEPS steps (or LEARN_CALLS outermost calls without a step:
  inference); then those classes' `forward` is wrapped (depth-0 calls timed, summed per
  optimizer step) and the global hooks are removed. Classes without parameters (the loss)
  are left alone: their time is not worth a wrapper's cost. Nothing is stored on the
  script's module objects, so pickling a model is unchanged. A class whose instances
  override `forward` per instance (torch.compile's wrapper) is not timed.
- Host time between steps (data loading, host-side work): at the first timed outermost
  forward after an optimizer step, the time since that step's end minus the time spent inside
  the wrapped collective calls meanwhile (floored at 0), one per step, median of the last
  FORWARD_WINDOW. Why: in DDP every rank's step lasts as long as the slowest's (the fast ranks
  wait in backward's allreduce), and the forward excludes the data, so a rank slow at loading
  its batch shows in neither; this gap is where it does show, and a collective called there (a
  barrier after a checkpoint) is waiting for the others, not work. Both ends are read from
  CLOCK_MONOTONIC and are reads made anyway (the step's `last_step_ns`, the forward's start),
  so a step pays a few attribute reads and a deque append, a wrapped collective call two clock
  reads (bench/PROGRESS.md). Limits: with gradient accumulation only the gap before a step's
  first forward counts (the later micro-batches' loading is not seen); a model that is never
  timed (torch.compile'd) gives no host time; an `async_op=True` collective returns once
  issued, so its wait (`work.wait()`) is not subtracted; an evaluation under no_grad between
  two steps is not a timed forward, so it counts as host time.
- Automatic sections: `torch.save`/`torch.load`, `torch.distributed.checkpoint`'s
  save/load/async_save (async: the synchronous part) and `DataLoader.__iter__` are wrapped to
  open `auto:<name>` around the call; an iterator's first and last batch (its workers' start
  and shutdown) are `auto:DataLoader.epoch`.
"""

from __future__ import annotations

import collections
import functools
import os
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

LEARN_STEPS = 3
"""Optimizer steps under global module hooks before the outermost classes are wrapped..."""
LEARN_CALLS = 64
"""...or outermost module calls, whichever comes first."""
FORWARD_WINDOW = 16
MAX_AUTO_SECTIONS = 16
COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_coalesced",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
)
AUTO_SECTIONS = {
    "torch": (("save", "auto:torch.save"), ("load", "auto:torch.load")),
    "torch.serialization": (("save", "auto:torch.save"), ("load", "auto:torch.load")),
    "torch.distributed.checkpoint": (
        ("save", "auto:dcp.save"),
        ("load", "auto:dcp.load"),
        ("async_save", "auto:dcp.async_save"),
    ),
}


class Counters:
    """What the hooks advance; plain attributes (the GIL orders them), read by the sampler."""

    def __init__(self) -> None:
        self.steps = 0
        self.last_step_ns = 0
        """CLOCK_MONOTONIC of the last optimizer step (0: none yet)."""
        self.called = 0
        """Calls of torch.distributed's collective functions entered..."""
        self.returned = 0
        """...and returned (an `async_op=True` call returns once issued)."""
        self.forward_ns = 0
        """Time in outermost forward calls since the last optimizer step."""
        self.forward_window: collections.deque[int] = collections.deque(maxlen=FORWARD_WINDOW)
        """Outermost forward time per optimizer step, the last FORWARD_WINDOW steps (ns)."""
        self.collective_ns = 0
        """Time inside torch.distributed's collective functions, all calls (CLOCK_MONOTONIC)."""
        self.collective_ns_at_step = 0
        """`collective_ns` when the last optimizer step ended."""
        self.step_ended = False
        """An optimizer step ended and no timed outermost forward began since."""
        self.host_window: collections.deque[int] = collections.deque(maxlen=FORWARD_WINDOW)
        """Host time before each step's first timed forward, the last FORWARD_WINDOW (ns)."""
        self.depth = 0
        self.forward_started = 0
        self.roots: dict[type, bool] = {}
        """Classes called at depth 0 while learning -> whether one of them had parameters."""
        self.learning = False
        self.outermost_calls = 0
        """Outermost module calls seen while learning."""
        self.auto: list[tuple[str, int]] = []
        """Automatic sections open: (name, CLOCK_MONOTONIC when opened), oldest first."""
        self.auto_lock = threading.Lock()


class TorchHooks:
    """Installs the hooks into a counters object; `remove` puts torch back as it was."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters
        self._handles: list[Any] = []
        self._learning_handles: list[Any] = []
        self._patches: list[tuple[Any, str, Any, bool]] = []
        """(owner, attribute, original, whether the owner had it in its own __dict__)."""

    def on_torch(self, torch: ModuleType) -> None:
        """Called once torch has been imported (torch/__init__ imports optim, nn, utils.data
        and distributed itself)."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._handles.append(register_optimizer_step_post_hook(self._on_step))
        self._learn_roots()
        for module_name in ("torch", "torch.serialization"):
            self._wrap_sections(_module(module_name))
        self._wrap_sections_of(torch.utils.data.DataLoader, "__iter__", "auto:DataLoader.iter")
        base = getattr(torch.utils.data.dataloader, "_BaseDataLoaderIter", None)
        if base is not None and callable(getattr(base, "__next__", None)):
            self._patch(base, "__next__", _epoch_edges(self.counters, base.__next__))
        if torch.distributed.is_available():
            self._wrap_collectives(torch.distributed)

    def on_checkpoint(self, dcp: ModuleType) -> None:
        self._wrap_sections(dcp)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for owner, name, original, own in reversed(self._patches):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self._patches.clear()
        self.counters.learning = False

    # -- steps and forward time ------------------------------------------------------------

    def _on_step(self, optimizer: object, args: object, kwargs: object) -> None:
        counters = self.counters
        counters.steps += 1
        counters.last_step_ns = time.monotonic_ns()
        counters.collective_ns_at_step = counters.collective_ns
        counters.step_ended = True
        if counters.forward_ns:
            counters.forward_window.append(counters.forward_ns)
            counters.forward_ns = 0
        if counters.learning and counters.steps >= LEARN_STEPS and counters.depth == 0:
            self._promote()

    def _learn_roots(self) -> None:
        import torch
        from torch.nn.modules import module

        counters = self.counters
        counters.learning = True
        clock = time.monotonic_ns

        grad_enabled = torch.is_grad_enabled

        def pre(mod: object, args: object) -> None:
            depth = counters.depth
            if depth == 0 and counters.outermost_calls >= LEARN_CALLS:
                # This call already looked its forward up: it runs untimed, without hooks.
                self._promote()
                return
            counters.depth = depth + 1
            if depth == 0:
                counters.outermost_calls += 1
                cls = type(mod)
                counters.roots[cls] = counters.roots.get(cls, False) or _has_parameters(mod)
                counters.forward_started = started = clock() if grad_enabled() else 0
                if started and counters.step_ended:
                    _host_time_ended(counters, started)

        def post(mod: object, args: object, output: object) -> None:
            counters.depth = depth = max(counters.depth - 1, 0)
            if depth == 0 and counters.forward_started:
                counters.forward_ns += clock() - counters.forward_started

        self._learning_handles = [
            module.register_module_forward_pre_hook(pre),
            module.register_module_forward_hook(post, always_call=True),
        ]
        self._handles.extend(self._learning_handles)

    def _promote(self) -> None:
        """Replace the global module hooks by wrappers on the outermost classes' forward."""
        import torch

        counters = self.counters
        counters.learning = False
        for handle in self._learning_handles:
            handle.remove()
            self._handles.remove(handle)
        for cls, trains in counters.roots.items():
            original = getattr(cls, "forward", None)
            if trains and callable(original):  # a loss module's time is not worth its cost
                timed = _timed_forward(counters, original, torch.is_grad_enabled)
                self._patch(cls, "forward", timed)

    # -- collectives and sections -----------------------------------------------------------

    def _wrap_collectives(self, dist: ModuleType) -> None:
        counters = self.counters
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if callable(original):
                self._patch(dist, name, _counted(counters, original))

    def _wrap_sections(self, module: ModuleType | None) -> None:
        if module is None:
            return
        for attribute, section in AUTO_SECTIONS.get(module.__name__, ()):
            self._wrap_sections_of(module, attribute, section)

    def _wrap_sections_of(self, owner: Any, attribute: str, section: str) -> None:
        original = getattr(owner, attribute, None)
        if callable(original):
            self._patch(owner, attribute, _sectioned(self.counters, section, original))

    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        own = name in vars(owner)
        original = vars(owner)[name] if own else None
        setattr(owner, name, replacement)
        self._patches.append((owner, name, original, own))


def _module(name: str) -> ModuleType | None:
    import sys

    return sys.modules.get(name)


def _has_parameters(module: Any) -> bool:
    parameters = getattr(module, "parameters", None)
    return callable(parameters) and next(iter(parameters()), None) is not None


def _timed_forward(
    counters: Counters, original: Callable[..., Any], grad_enabled: Callable[[], bool]
) -> Callable[..., Any]:
    """Time the outermost call of `original` (a class's forward) that trains: evaluation
    under no_grad is not the compute a straggler is slow at."""
    clock = time.monotonic_ns

    @functools.wraps(original)
    def forward(self: object, *args: Any, **kwargs: Any) -> Any:
        if counters.depth or not grad_enabled():  # inside an outermost call, or evaluating
            return original(self, *args, **kwargs)
        counters.depth = 1
        started = clock()
        if counters.step_ended:  # inline: the one call per step on the training path
            counters.step_ended = False
            host = started - counters.last_step_ns
            host -= counters.collective_ns - counters.collective_ns_at_step
            counters.host_window.append(host if host > 0 else 0)
        try:
            return original(self, *args, **kwargs)
        finally:
            counters.forward_ns += clock() - started
            counters.depth = 0

    return forward


def _host_time_ended(counters: Counters, forward_started_ns: int) -> None:
    """The first timed forward after a step: the host time before it joins the window."""
    counters.step_ended = False
    waited = counters.collective_ns - counters.collective_ns_at_step
    counters.host_window.append(max(forward_started_ns - counters.last_step_ns - waited, 0))


def _counted(counters: Counters, original: Callable[..., Any]) -> Callable[..., Any]:
    clock = time.monotonic_ns

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        counters.called += 1
        started = clock()
        try:
            return original(*args, **kwargs)
        finally:
            counters.collective_ns += clock() - started
            counters.returned += 1

    return collective


def _sectioned(counters: Counters, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def sectioned(*args: Any, **kwargs: Any) -> Any:
        entry = (name, time.monotonic_ns())
        with counters.auto_lock:
            opened = len(counters.auto) < MAX_AUTO_SECTIONS
            if opened:
                counters.auto.append(entry)
        try:
            return original(*args, **kwargs)
        finally:
            if opened:
                with counters.auto_lock:
                    _remove_entry(counters.auto, entry)

    return sectioned


def _epoch_edges(counters: Counters, original: Callable[..., Any]) -> Callable[..., Any]:
    """A DataLoader iterator's first batch (its workers starting) and its last call (the
    workers' shutdown, before StopIteration) take seconds on a busy machine: an automatic
    section, `auto:DataLoader.epoch`. The batches between pay one attribute read."""
    sectioned = _sectioned(counters, "auto:DataLoader.epoch", original)

    @functools.wraps(original)
    def __next__(self: Any) -> Any:
        yielded = getattr(self, "_num_yielded", None)
        if yielded == 0:
            return sectioned(self)
        try:
            last = yielded is not None and yielded >= len(self)
        except TypeError:  # an iterable dataset: no length
            last = False
        return sectioned(self) if last else original(self)

    return __next__


def _remove_entry(entries: list[tuple[str, int]], entry: tuple[str, int]) -> None:
    for index, item in enumerate(entries):
        if item is entry:
            del entries[index]
            return


def _reset_after_fork(counters: Counters) -> None:
    """A lock held by a thread that did not survive the fork would stay held."""
    counters.auto_lock = threading.Lock()
    counters.auto = []


def register_fork_reset(counters: Counters) -> None:
    os.register_at_fork(after_in_child=lambda: _reset_after_fork(counters))
