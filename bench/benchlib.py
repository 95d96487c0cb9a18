"""Shared helpers for the health benchmarks: launching `ftd serve`, reading its event log,
describing the machine, summarising samples."""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def under_ftd() -> bool:
    """True in a rank started by `ftd serve` (the benchmark scripts run themselves as ranks)."""
    return "FTD_SOCKET" in os.environ and "RANK" in os.environ


def child_env() -> dict[str, str]:
    """The environment for the daemon: this checkout's ftd and ftd_client first."""
    paths = [str(ROOT), str(ROOT / "client")]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


def serve(
    work: Path, run_id: str, script: Path, script_args: list[str], *flags: str
) -> subprocess.Popen[bytes]:
    """Start `python -m ftd serve ... script script_args` with its output in `work`."""
    cmd = [
        sys.executable, "-m", "ftd", "serve",
        "--api-port", "off", "--log-dir", str(work), "--run-id", run_id,
        *flags, str(script), *script_args,
    ]  # fmt: skip
    out = (work / f"{run_id}.out").open("wb")
    err = (work / f"{run_id}.err").open("wb")
    return subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=child_env())


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def events(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def wait_for(path: Path, timeout_s: float) -> str:
    """The contents of `path` once it exists and is non-empty."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = path.read_text()
        except FileNotFoundError:
            text = ""
        if text.strip():
            return text
        time.sleep(0.01)
    raise TimeoutError(f"{path} did not appear within {timeout_s}s")


def wait_gone(pid: int, timeout_s: float) -> float | None:
    """When the process `pid` was gone (wall clock), as its pidfd tells it: the kernel's end of
    the process, the earliest moment any launcher can know of it. None if it outlived
    `timeout_s`; ProcessLookupError if it was gone (reaped) before the pidfd was opened."""
    import select

    fd = os.pidfd_open(pid)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return time.time() if poller.poll(int(1000 * timeout_s)) else None
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def machine() -> dict[str, str]:
    model = "unknown"
    try:
        for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True, check=False
        ).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "not installed"
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "nproc": str(os.cpu_count()),
        "cpu": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch_version,
        "unix max_dgram_qlen": _read("/proc/sys/net/unix/max_dgram_qlen"),
        "loadavg at start": _read("/proc/loadavg"),
    }


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "?"


def print_machine(info: dict[str, str]) -> None:
    for key, value in info.items():
        print(f"# {key}: {value}")


def summary(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": float(len(values)),
    }
