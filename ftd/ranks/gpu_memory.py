"""Between attempts, the node's GPUs get their memory back before new ranks start.

A rank that was killed can leave its GPU memory held for a while (the driver tears its context
down, an orphaned child still holds it): new ranks that start then fail to allocate, and the
restart is lost. So, where NVML is present (pynvml loads and finds devices), the supervisor
waits after stopping the ranks until every GPU's used memory is at most
`gpu_memory_tolerance_mb`, looking every `gpu_memory_poll_interval` seconds, for at most
`gpu_memory_reclaim_timeout` seconds (NVRx's parameters and defaults); past it, the next
attempt starts anyway and says which GPUs still held what. Without NVML nothing is waited for.

NVML's calls block (a hung driver can take seconds): they run in a thread, bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import time
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ftd.config.ft import FaultToleranceConfig
from ftd.status.event_kind import EventKind
from ftd.status.events import EventLog
from ftd.tasks import within

log = logging.getLogger("ftd.ranks")

MIB = 1024 * 1024


@dataclass(frozen=True)
class Held:
    """What the GPUs held when the wait ended."""

    used_mb: dict[int, float]
    """GPU index -> memory in use (MiB), for the GPUs over the tolerance."""
    waited_s: float
    released: bool


def load_nvml() -> ModuleType | None:
    """pynvml, initialised, where NVML is present; None elsewhere (no GPU, no driver, no
    package: the common case of a CPU machine, said by nothing)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pynvml's own deprecation notice
            nvml = importlib.import_module("pynvml")
        nvml.nvmlInit()
        if int(nvml.nvmlDeviceGetCount()) < 1:
            return None
        return nvml
    except Exception:  # ImportError, NVMLError of any kind, a broken stand-in
        return None


def used_mb(nvml: Any) -> dict[int, float]:
    """Every GPU's memory in use, in MiB (GPUs NVML cannot read are left out)."""
    used: dict[int, float] = {}
    for index in range(int(nvml.nvmlDeviceGetCount())):
        with contextlib.suppress(Exception):
            info = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(index))
            used[index] = float(info.used) / MIB
    return used


class GpuMemory:
    def __init__(self, ft: FaultToleranceConfig, events: EventLog) -> None:
        self.timeout_s = ft.gpu_memory_reclaim_timeout
        self.tolerance_mb = ft.gpu_memory_tolerance_mb
        self.poll_s = ft.gpu_memory_poll_interval
        self._events = events
        self._nvml: ModuleType | None = None
        self._looked = False

    async def reclaimed(self, stop: asyncio.Event) -> Held | None:
        """Wait until every GPU's memory is back under the tolerance (or the bound, or `stop`);
        None where there is no NVML or nothing to wait for."""
        if self.timeout_s <= 0:
            return None
        if not self._looked:
            self._looked = True
            self._nvml = await asyncio.to_thread(load_nvml)
        nvml = self._nvml
        if nvml is None:
            return None
        started = time.monotonic()
        deadline = started + self.timeout_s
        over = await self._over(nvml)
        if not over:
            return None
        log.info(
            "waiting for GPU memory to be released before the next attempt: %s",
            _described(over),
        )
        while over and time.monotonic() < deadline and not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await within(stop.wait(), min(self.poll_s, deadline - time.monotonic()))
            over = await self._over(nvml)
        waited = time.monotonic() - started
        self._events.emit(
            EventKind.GPU_MEMORY_RECLAIMED,
            released=not over,
            waited_s=round(waited, 3),
            held_mb={str(gpu): round(mb) for gpu, mb in over.items()},
        )
        if over:
            log.warning(
                "GPU memory still held after %.1fs (--ft-gpu-memory-reclaim-timeout %g): %s; "
                "the next attempt starts anyway",
                waited,
                self.timeout_s,
                _described(over),
            )
        else:
            log.info("GPU memory released after %.1fs", waited)
        return Held(over, round(waited, 3), not over)

    async def _over(self, nvml: ModuleType) -> dict[int, float]:
        try:
            used = await within(asyncio.to_thread(used_mb, nvml), self.poll_s + 5)
        except TimeoutError:
            return {}  # a driver that does not answer: nothing to wait for that it would say
        return {gpu: mb for gpu, mb in used.items() if mb > self.tolerance_mb}


def _described(over: dict[int, float]) -> str:
    return ", ".join(f"GPU {gpu} {mb:.0f} MiB" for gpu, mb in sorted(over.items()))
