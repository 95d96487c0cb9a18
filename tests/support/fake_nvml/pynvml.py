"""A stand-in for pynvml where no GPU is (tests/ranks/test_gpu_memory.py): each GPU's memory
in use is read, at every call, from the JSON list of MiB in the file FTD_TEST_FAKE_NVML names,
so a test releases memory by rewriting it."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace


def _used() -> list[float]:
    with open(os.environ["FTD_TEST_FAKE_NVML"]) as file:
        return [float(mb) for mb in json.load(file)]


def nvmlInit() -> None:
    _used()


def nvmlDeviceGetCount() -> int:
    return len(_used())


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    return index


def nvmlDeviceGetMemoryInfo(handle: int) -> SimpleNamespace:
    return SimpleNamespace(used=int(_used()[handle] * 1024 * 1024), total=80 * 1024**3)
