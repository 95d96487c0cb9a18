"""Between attempts, GPU memory released before new ranks start (issue 40 item 5): with NVML
(here a stand-in pynvml, tests/support/fake_nvml) the daemon waits, bounded, until every GPU
holds at most --ft-gpu-memory-tolerance-mb; without NVML it waits for nothing."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from ftd.config.ft import FaultToleranceConfig
from ftd.ranks.gpu_memory import GpuMemory, load_nvml
from ftd.status.events import EventLog
from tests.conftest import ServeFactory

FAKE_NVML = Path(__file__).parents[1] / "support" / "fake_nvml"


def nvml_env(used: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(FAKE_NVML), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "FTD_TEST_FAKE_NVML": str(used)}


async def test_the_next_attempt_waits_for_the_gpus_memory(
    serve: ServeFactory, tmp_path: Path
) -> None:
    used = tmp_path / "used.json"
    used.write_text(json.dumps([100, 4096]))  # the failed rank's GPU will still hold memory
    run = await serve(
        "--nproc-per-node", "1", "--max-restarts", "2",
        "--ft-gpu-memory-poll-interval", "0.1", "--ft-gpu-memory-reclaim-timeout", "120",
        script_args=("--fail-attempts", "1", "--fail-mode", "exit:1"),
        env=nvml_env(used),
    )  # fmt: skip
    await run.stderr.expect("waiting for GPU memory to be released before the next attempt: "
                            "GPU 1 4096 MiB", timeout=60)  # fmt: skip
    assert "ready a1 r0" not in run.stdout.text
    used.write_text(json.dumps([100, 300]))
    assert await run.wait() == 0, run.stderr.text[-3000:]
    [reclaimed] = run.event_data("gpu_memory_reclaimed")
    assert reclaimed["released"] is True and reclaimed["held_mb"] == {}, reclaimed
    assert "GPU memory released after" in run.stderr.text


async def test_memory_still_held_at_the_bound_delays_the_restart_no_longer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    used = tmp_path / "used.json"
    used.write_text(json.dumps([8192]))
    monkeypatch.setenv("FTD_TEST_FAKE_NVML", str(used))
    monkeypatch.syspath_prepend(str(FAKE_NVML))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)  # torch imported the real one
    events = EventLog(None)
    ft = FaultToleranceConfig(gpu_memory_reclaim_timeout=0.3, gpu_memory_poll_interval=0.05)
    held = await GpuMemory(ft, events).reclaimed(asyncio.Event())
    assert held is not None and not held.released and held.used_mb == {0: 8192.0}
    assert 0.3 <= held.waited_s < 5
    [event] = [e for e in events.since(0) if e.kind == "gpu_memory_reclaimed"]
    assert event.data["held_mb"] == {"0": 8192}
    stop = asyncio.Event()
    stop.set()  # a signal ends the wait at once
    ft = FaultToleranceConfig(gpu_memory_reclaim_timeout=60)
    held = await asyncio.wait_for(GpuMemory(ft, EventLog(None)).reclaimed(stop), 5)
    assert held is not None and not held.released


def test_without_nvml_nothing_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTD_TEST_FAKE_NVML", "/nonexistent/used.json")
    monkeypatch.syspath_prepend(str(FAKE_NVML))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    assert load_nvml() is None  # a stand-in that cannot read its devices: no NVML
