"""A stand-in for pynvml where no GPU is (tests/ranks/test_gpu_memory.py): each GPU's memory
in use is read, at every call, from the JSON list of MiB in the file FTD_TEST_FAKE_NVML names,
so a test releases memory by rewriting it."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace


def _used() -> list[float | None]:
    """MiB in use by GPU; null for a GPU that is lost (NVML raises for it)."""
    with open(os.environ["FTD_TEST_FAKE_NVML"]) as file:
        return [None if mb is None else float(mb) for mb in json.load(file)]


def nvmlInit() -> None:
    _used()


def nvmlDeviceGetCount() -> int:
    return len(_used())


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    return index


def nvmlDeviceGetMemoryInfo(handle: int) -> SimpleNamespace:
    used = _used()[handle]
    if used is None:
        raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
    return SimpleNamespace(used=int(used * 1024 * 1024), total=80 * 1024**3)
