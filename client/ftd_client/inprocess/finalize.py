"""Finalize: run after the abort, before the health check and the next round's barrier."""

from __future__ import annotations

import abc
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ftd_client.inprocess.exceptions import TimeoutError
from ftd_client.inprocess.state import FrozenState


class Finalize(abc.ABC):
    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        """Release what the failed round held; return `state` (or a copy)."""


class ThreadedFinalize(Finalize):
    """Runs `fn(*args, **kwargs)` in a thread, on this rank's CUDA device where CUDA is in use;
    TimeoutError when it takes longer than `timeout` (the thread is left behind). NVRx's
    refuses to run without CUDA; this one runs the function on CPU jobs too."""

    def __init__(
        self,
        timeout: timedelta,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | None = (),
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.timeout = timeout
        self.fn = fn
        self.args = tuple(args or ())
        self.kwargs = dict(kwargs or {})

    def __repr__(self) -> str:
        return f"ThreadedFinalize(timeout={self.timeout!r}, fn={self.fn!r})"

    def __call__(self, state: FrozenState) -> FrozenState:
        device = _cuda_device()

        def run() -> None:
            if device is not None:
                import torch

                torch.cuda.set_device(device)
            self.fn(*self.args, **self.kwargs)

        run_bounded(run, self.timeout, f"ftd-finalize-{state.rank}", f"{self!r}")
        return state


def run_bounded(fn: Callable[[], object], timeout: timedelta, name: str, what: str) -> None:
    """`fn()` in a daemon thread; its exception re-raised here, TimeoutError after `timeout`
    (the thread is left behind: a wedged call cannot be cancelled)."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as error:  # re-raised in the caller's thread
            failure.append(error)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout.total_seconds())
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout}")
    if failure:
        raise failure[0]


def _cuda_device() -> int | None:
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    local_rank = os.environ.get("LOCAL_RANK")
    return int(local_rank) if local_rank else int(torch.cuda.current_device())
