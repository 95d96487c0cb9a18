"""Node health before every rendezvous (NVRx's pre-rendezvous checks, issue 40 item 3).

Before it joins a round a node checks itself; an unhealthy node sits out: it does not join,
says why (a `node_unhealthy` event, its state's reason, one log line per new reason) and looks
again every `node_health_check_interval` seconds, so the round forms without it where enough
nodes are left (a node waiting beyond the round's size, a spare, takes its place) and waits,
saying who is missing, where not. After `node_health_check_failures` looks in a row it excludes
itself (as `ftd exclude` would: an operator's `ftd readmit` lets it back).

The checks, each bounded, each only where it is configured or its hardware is there:
- `--node-health-check CMD`: the operator's command (NVRx's health service behind a script, a
  site's own checks); exit status 0 is healthy, else its last output line is the reason;
- `storage_healthcheck_path` (NVRx's): comma-separated paths that must be reachable
  directories (a hung network file system is a timeout, not a hung daemon);
- NIC link state (`link_state_path_template`, NVRx's, e.g.
  /sys/class/infiniband/{nic}/ports/1/state): a port that was ACTIVE at the first look and is
  not now;
- GPUs through NVML, where it loads: every device must answer;
- `node_health_check_endpoint` (NVRx's): NVIDIA's node health check service (nvhcd.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import logging
import os
import shlex
import stat
from pathlib import Path
from types import ModuleType

from ftd.config.serve import ServeConfig
from ftd.coordination import CoordinationError
from ftd.coordination.base import Coordinator
from ftd.ranks.gpu_memory import load_nvml
from ftd.status.board import StatusBoard
from ftd.status.event_kind import EventKind
from ftd.status.events import EventLog
from ftd.supervision.nvhcd import Nvhcd
from ftd.tasks import within
from ftd.text import escape

log = logging.getLogger("ftd.supervision")

MAX_OUTPUT_BYTES = 64 * 1024
MAX_REASON = 300
PATH_TIMEOUT_S = 5.0
MAX_PORTS = 256


class NodeHealth:
    def __init__(
        self, config: ServeConfig, events: EventLog, board: StatusBoard, coordinator: Coordinator
    ) -> None:
        self._ft = config.ft
        self._node_id = config.node_id
        self._events = events
        self._board = board
        self._coordinator = coordinator
        self._active_ports: set[str] | None = None
        self._nvml_looked = False
        self._nvml: ModuleType | None = None
        endpoint = self._ft.node_health_check_endpoint
        self._nvhcd = Nvhcd(endpoint, self._ft.node_health_check_timeout) if endpoint else None
        self.failures = 0
        """Looks in a row that found the node unhealthy."""

    async def until_healthy(self, stop: asyncio.Event) -> bool:
        """Wait until the node is healthy (True) or `stop` is set (False); CoordinationError
        `excluded` once it failed node_health_check_failures looks in a row."""
        said = None
        while not stop.is_set():
            reason = await self.check()
            self._board.health_checked(reason)
            if reason is None:
                if self.failures:
                    log.info("node healthy again after %d failed check(s)", self.failures)
                    self._events.emit(EventKind.NODE_HEALTHY, failures=self.failures)
                self.failures = 0
                return True
            self.failures += 1
            limit = self._ft.node_health_check_failures
            self._events.emit(
                EventKind.NODE_UNHEALTHY, reason=reason, failures=self.failures, limit=limit
            )
            if reason != said:
                log.error("node unhealthy, sitting out of the rendezvous: %s", reason)
                said = reason
            if self.failures == 1 and (rnd := self._coordinator.round) is not None:
                # Marked in the round it ran: the next round gives it no last call.
                with contextlib.suppress(CoordinationError):
                    await self._coordinator.unhealthy(rnd, self._node_id)
            if limit and self.failures >= limit:
                why = f"unhealthy in {self.failures} checks in a row: {reason}"
                await self._coordinator.exclude(self._node_id, why)
                raise CoordinationError(why, "excluded")
            with contextlib.suppress(TimeoutError):
                await within(stop.wait(), self._ft.node_health_check_interval)
        return False

    async def check(self) -> str | None:
        """The first reason this node is unhealthy, or None."""
        ft = self._ft
        if ft.node_health_check:
            reason = await run_check(ft.node_health_check, ft.node_health_check_timeout)
            if reason is not None:
                return reason
        if self._nvhcd is not None and (reason := await self._nvhcd.check()) is not None:
            return reason
        for path in (ft.storage_healthcheck_path or "").split(","):
            if path.strip() and (reason := await storage_reason(path.strip())) is not None:
                return reason
        if ft.link_state_path_template and (reason := self._nic_reason()) is not None:
            return reason
        return await self._gpu_reason()

    def _nic_reason(self) -> str | None:
        template = self._ft.link_state_path_template or ""
        states = link_states(template)
        active = {port for port, state in states.items() if "ACTIVE" in state}
        if self._active_ports is None:
            self._active_ports = active
            return None
        down = sorted(self._active_ports - active)
        if down:
            return f"NIC port {down[0]} is {states.get(down[0], 'gone')} (it was ACTIVE)"
        return None

    async def _gpu_reason(self) -> str | None:
        if not self._nvml_looked:
            self._nvml_looked = True
            self._nvml = await asyncio.to_thread(load_nvml)
        nvml = self._nvml
        if nvml is None:
            return None

        def probe() -> str | None:
            for index in range(int(nvml.nvmlDeviceGetCount())):
                try:
                    nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(index))
                except Exception as error:
                    return f"GPU {index} does not answer NVML: {error}"
            return None

        try:
            return await within(asyncio.to_thread(probe), PATH_TIMEOUT_S)
        except TimeoutError:
            return f"NVML did not answer within {PATH_TIMEOUT_S:g}s"
        except Exception as error:
            return f"NVML failed: {error}"


async def run_check(command: str, timeout_s: float) -> str | None:
    """The operator's check: None when it exits 0, else why not (its last output line)."""
    try:
        argv = shlex.split(command)
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    except (OSError, ValueError) as error:
        return f"the health check {command!r:.80} cannot run: {error}"
    assert proc.stdout is not None
    stdout = proc.stdout

    async def tail() -> bytes:
        """Its output to the end, the last MAX_OUTPUT_BYTES kept (its last line is the reason)."""
        kept = b""
        while chunk := await stdout.read(MAX_OUTPUT_BYTES):
            kept = (kept + chunk)[-MAX_OUTPUT_BYTES:]
        return kept

    try:
        output = await within(tail(), timeout_s)
        code = await within(proc.wait(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        await proc.wait()
        return f"the health check did not end within {timeout_s:g}s"
    if code == 0:
        return None
    lines = [line for line in output.decode(errors="replace").splitlines() if line.strip()]
    said = escape(lines[-1].strip(), limit=MAX_REASON) if lines else f"exit status {code}"
    return f"the health check failed: {said}"


async def storage_reason(path: str) -> str | None:
    """Why `path` is no reachable directory, or None (bounded: a hung mount is a timeout)."""

    def probe() -> str | None:
        if not os.path.isabs(path):
            return f"storage path {path!r:.80} is not absolute"
        try:
            info = os.stat(path)
        except OSError as error:
            return f"storage path {path}: {error.strerror}"
        if not stat.S_ISDIR(info.st_mode) or not os.access(path, os.R_OK | os.X_OK):
            return f"storage path {path} is no readable directory"
        return None

    try:
        return await within(asyncio.to_thread(probe), PATH_TIMEOUT_S)
    except TimeoutError:
        return f"storage path {path} did not answer within {PATH_TIMEOUT_S:g}s"


def link_states(template: str) -> dict[str, str]:
    """Each NIC port's state file (the template's `{nic}` matched by any name) -> its text."""
    if "{nic}" not in template:
        return {}
    states: dict[str, str] = {}
    pattern = template.replace("*", "[*]").replace("{nic}", "*")
    for path in sorted(glob.glob(pattern))[:MAX_PORTS]:
        with contextlib.suppress(OSError):
            states[path] = Path(path).read_text(errors="replace")[:200]
    return states
