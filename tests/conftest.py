"""Fixtures: real `ftd serve` daemons as subprocesses, awaited through their output and pidfds."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import io
import itertools
import json
import os
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock
from hypothesis import settings

from tests.support import fuzzing
from tests.support.etcd_cluster import (
    ClusterFactory,
    EtcdCluster,
    etcd,  # noqa: F401  (the fixture: real etcd clusters)
)
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("FTD_ZYGOTE_WARM_AFTER_S", "86400")
"""Every daemon a test starts inherits it: the zygote's warming (an import of torch._dynamo once
the first ranks ran 30 s) is tests/ranks/test_zygote.py's subject; elsewhere a restart that came
while it imported waited for the import (many seconds on a loaded machine) in tests whose ranks
never use it."""
BIN = Path(__file__).resolve().parent / "bin"
WORKER = BIN / "worker.py"

settings.register_profile("ftd", deadline=None)
settings.load_profile("ftd")
"""No wall-clock deadline per example: on a busy machine (two CPU hogs beside the suite, a CI
run) a 60 ms example took 374 ms and failed a property test that holds (test_spacing). What an
input may cost is the fuzz targets' business: their budgets are CPU time (tests/support/fuzzing)."""


@dataclass
class OutputStream:
    """Lines of a child's stream as they arrive; `expect` awaits a matching line."""

    lines: list[str] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    closed: bool = False

    async def pump(self, reader: asyncio.StreamReader, echo: str | None) -> None:
        """Read the stream to its end; each line also goes to this process's stderr after
        `echo` (pytest shows it for a failed test: what the daemons said when it failed)."""
        while raw := await reader.readline():
            line = raw.decode(errors="replace").rstrip("\n")
            if echo is not None:
                print(f"{echo}{line}", file=sys.stderr)
            async with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        async with self.changed:
            self.closed = True
            self.changed.notify_all()

    async def expect(self, pattern: str, timeout: float = 60.0, start: int = 0) -> re.Match[str]:
        regex = re.compile(pattern)

        async def find() -> re.Match[str]:
            seen = start
            async with self.changed:
                while True:
                    for line in self.lines[seen:]:
                        if match := regex.search(line):
                            return match
                    seen = len(self.lines)
                    if self.closed:
                        raise AssertionError(f"stream closed without a line matching {pattern!r}")
                    await self.changed.wait()

        return await asyncio.wait_for(find(), timeout)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def event_lines(run_dir: Path) -> list[dict[str, Any]]:
    """Every line of `run_dir`'s events.jsonl, each parsed whole (a torn line fails here)."""
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    parsed = []
    for number, line in enumerate(lines, 1):
        try:
            parsed.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"events.jsonl line {number} is torn: {line!r}") from None
    return parsed


def events_in(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    """The events of `kind` in `run_dir`'s events.jsonl, whole (id, time, kind, data)."""
    return [event for event in event_lines(run_dir) if event["kind"] == kind]


@dataclass
class Serve:
    proc: asyncio.subprocess.Process
    log_dir: Path
    run_id: str
    out: Path
    stdout: OutputStream
    stderr: OutputStream
    pumps: list[asyncio.Task[None]]

    @property
    def run_dir(self) -> Path:
        return self.log_dir / self.run_id

    def attempt_dir(self, attempt: int) -> Path:
        return self.run_dir / f"attempt_{attempt}"

    async def rank_pids(self, attempt: int = 0) -> list[int]:
        """The attempt's local rank pids, from the daemon's own line: a forked rank may print
        before the daemon has recorded it in status.json."""
        line = await self.stderr.expect(rf"attempt {attempt}: started local ranks \{{([^}}]*)\}}")
        return [int(pid) for pid in re.findall(r"\d+: (\d+)", line[1])]

    async def rank_socket(self) -> Path:
        """The ranks' socket: in the run directory, or in a private directory where the run
        directory's path is too long for it (as under pytest-xdist's deeper tmp paths)."""
        line = await self.stderr.expect(r"the ranks' socket is (\S+)")
        return Path(line[1])

    def events(self, kind: str) -> list[dict[str, Any]]:
        """This run's events of `kind` so far, whole."""
        return events_in(self.run_dir, kind)

    def event_data(self, kind: str) -> list[dict[str, Any]]:
        """The data of this run's events of `kind` so far."""
        return [event["data"] for event in self.events(kind)]

    def status(self) -> dict[str, object]:
        data: dict[str, object] = json.loads((self.run_dir / "status.json").read_text())
        return data

    async def wait(self, timeout: float = 90.0) -> int:
        try:
            code = await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            tail = self.stderr.text[-6000:]
            raise AssertionError(f"ftd serve still runs after {timeout:.0f} s:\n{tail}") from None
        await asyncio.wait_for(asyncio.gather(*self.pumps), 10)
        return code

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)


ServeFactory = Callable[..., Awaitable[Serve]]


TORCH_FREE = frozenset(
    BIN / f"{name}.py"
    for name in ("argv_dump", "bad_error_file", "burst_rank", "chatty_rank", "dash_rank",
                 "escape_section", "nvrx_attack", "nvrx_field_attack", "nvrx_heartbeats",
                 "nvrx_sections", "nvrx_state", "probe_rank", "relay", "truth_rank", "stuck_rank")
)  # fmt: skip
"""Test ranks that never import torch (nor does ftd_client): their zygote need not preload it."""
TORCH_WHEN = {
    WORKER: frozenset({"--allreduce", "--record"}),
    BIN / "chaos_rank.py": frozenset({"gloo-hang"}),
    BIN / "health_worker.py": frozenset({"gloo-hang"}),
    BIN / "door_rank.py": frozenset({"section-hang"}),
}
"""Test ranks that import torch only when given one of these arguments (a flag, a mode)."""


def _without_torch(script: Path, flags: tuple[str, ...], script_args: tuple[str, ...]) -> bool:
    """Whether the daemon may start its zygote with `--preload none`: the ranks never import
    torch, and the test chose neither the start method nor the preload. It saves each daemon
    the zygote's import of torch (2-3 s of CPU on these machines) and keeps the zygote's fork
    path under test; the zygote's own tests (test_zygote.py) keep the default preload."""
    if any(
        flag.split("=")[0] in ("--start-method", "--start_method", "--preload") for flag in flags
    ):
        return False
    if script in TORCH_WHEN:
        return not TORCH_WHEN[script] & set(script_args)
    return script in TORCH_FREE


@pytest.fixture
async def serve(tmp_path: Path) -> AsyncIterator[ServeFactory]:
    """Start `ftd serve` as a subprocess; the daemon (and through it its ranks) is killed at
    teardown if the test left it running."""
    started: list[Serve] = []

    async def start(
        *flags: str,
        script: str | Path = WORKER,
        script_args: tuple[str, ...] = (),
        run_id: str = "test",
        env: dict[str, str] | None = None,
        api_port: str | None = "0",
        wrap: tuple[str, ...] = (),
    ) -> Serve:
        log_dir = tmp_path / "logs"
        out = tmp_path / "out"
        worker_args = ("--out", str(out)) if Path(script) == WORKER else ()
        if _without_torch(Path(script), flags, script_args):
            flags = ("--preload", "none", *flags)
        cmd = [
            *wrap,  # a command that ends by exec'ing the rest (prlimit, sh -c '...; exec "$@"')
            sys.executable,
            "-m",
            "ftd",
            "serve",
            "--log-dir",
            str(log_dir),
            "--run-id",
            run_id,
            *(("--api-port", api_port) if api_port is not None else ()),
            *flags,
            str(script),
            *worker_args,
            *script_args,
        ]
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL,
            cwd=str(ROOT),
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        stdout, stderr = OutputStream(), OutputStream()
        assert proc.stdout is not None and proc.stderr is not None
        tag = next((v for f, v in itertools.pairwise(flags) if f == "--node-id"), len(started))
        pumps = [
            asyncio.create_task(stdout.pump(proc.stdout, f"[{tag} out] ")),
            asyncio.create_task(stderr.pump(proc.stderr, f"[{tag} err] ")),
        ]
        run = Serve(proc, log_dir, run_id, out, stdout, stderr, pumps)
        started.append(run)
        return run

    yield start
    for run in started:
        if run.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                run.proc.kill()
            await run.proc.wait()
        # The pipes close when the last holder exits (the ranks inherit them): give the pumps
        # a moment to read EOF, then close whatever is left, so no transport is left to the GC.
        await asyncio.wait(run.pumps, timeout=10)
        for pump in run.pumps:
            pump.cancel()
        transport = getattr(run.proc, "_transport", None)
        if transport is not None:
            transport.close()
    # Whatever the test asserted, a daemon must not lose an error or get stuck leaving.
    careless = ("teardown gave up", "exception was never retrieved")
    slips = [
        "\n".join(run.stderr.lines[at : at + 40])  # the line and the traceback after it
        for run in started
        for at, line in enumerate(run.stderr.lines)
        if any(mark in line for mark in careless)
    ]
    assert not slips, "a daemon slipped:\n" + "\n---\n".join(slips)


async def await_api_event(
    url: str, kind: str, timeout: float = 60.0, token: str | None = None, **match: object
) -> dict[str, object]:
    """The first event of `kind` whose data has `match`, from the daemon's event stream (from
    its start: an event already sent counts)."""
    import aiohttp

    async def find() -> dict[str, object]:
        headers = {"Accept": "text/event-stream"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{url}/v1/events?since=0", headers=headers) as response,
        ):
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                event: dict[str, object] = json.loads(line[5:])
                data = event.get("data")
                if (
                    event.get("kind") == kind
                    and isinstance(data, dict)
                    and all(data.get(key) == value for key, value in match.items())
                ):
                    return event
        raise AssertionError(f"the event stream ended without a {kind} event matching {match}")

    return await asyncio.wait_for(find(), timeout)


async def wait_pids_gone(pids: list[int], timeout: float) -> list[int]:
    """Await each process's exit through a pidfd; the pids still alive at the timeout."""
    loop = asyncio.get_running_loop()
    waiters: dict[int, asyncio.Future[None]] = {}
    fds: list[int] = []
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        fds.append(fd)
        future: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, lambda f=future: f.done() or f.set_result(None))
        waiters[pid] = future
    try:
        if waiters:
            await asyncio.wait(waiters.values(), timeout=timeout)
        return [pid for pid, fut in waiters.items() if not fut.done()]
    finally:
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)


def pids_with_env(key: str, value: str) -> list[int]:
    """Live processes whose environment has key=value (zombies have an empty environ)."""
    marker = f"{key}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as environ:
                    if marker in environ.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                pass
    return found


@dataclass(frozen=True)
class Backend:
    """Where a test's daemons meet: `c10d` (a TCPStore on a fresh port, hosted by the first
    daemon) or `etcd` (one real member, started for the test)."""

    name: str
    etcd: EtcdCluster | None = None

    def endpoint(self) -> str:
        return self.etcd.rdzv_endpoint if self.etcd else f"127.0.0.1:{free_port()}"

    @property
    def in_rendezvous(self) -> str:
        """The log line of a daemon that has met the others' store (the first to: it hosts
        the TCPStore; under etcd it joined round 0 first, so it is node rank 0)."""
        return "hosting the rendezvous store" if self.etcd is None else r"joined round \d+ as"


C10D = Backend("c10d")


MEMORY_TRAIN = BIN / "memory_train.py"
MEMORY_TRAIN_STEPS = 60


@pytest.fixture
async def memory_train_reference(
    serve: ServeFactory, tmp_path_factory: pytest.TempPathFactory, worker_id: str
) -> Path:
    """The directory of final-<rank>.pt of tests/bin/memory_train.py, 2 ranks, 60 steps, no
    fault: what the memory tier's runs must end bit-identical to. One run per session, shared
    by the test workers (~6 CPU-s each time it is not run again)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if worker_id != "master" else base  # the session's, across workers
    done = shared / "memory-train-reference"
    lock = FileLock(str(shared / "memory-train-reference.lock"))
    await asyncio.to_thread(lock.acquire)
    try:
        if not all((done / f"final-{rank}.pt").exists() for rank in (0, 1)):
            run = await serve(
                "--nproc-per-node", "2", "--api-port", "off", "--preload", "torch._dynamo",
                script=MEMORY_TRAIN, run_id="reference", api_port=None,
                script_args=("--out", str(done), "--steps", str(MEMORY_TRAIN_STEPS)),
                env={"OMP_NUM_THREADS": "1"},
            )  # fmt: skip
            assert await run.wait(240) == 0, run.stderr.text[-3000:]
    finally:
        lock.release()
    return done


@pytest.fixture(params=["c10d", "etcd"])
async def backend(
    request: pytest.FixtureRequest,
    etcd: ClusterFactory,  # noqa: F811  (the fixture imported above)
) -> Backend:
    if request.param == "etcd":
        return Backend("etcd", await etcd(1))
    return C10D


# -- the fuzz targets' long run (tests/support/fuzzing.py) -----------------------------------------

_TARGETS_OF: Counter[str] = Counter()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "fuzz(decoder, examples): a fuzz target of one decoder (tests/support/fuzzing.py)",
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    """Close the /dev/null that NVRx's fault_tolerance.utils opens at import for a module-level
    pickler and never closes: the in-process NVRx tests would end each run with its
    ResourceWarning (no warning filter reaches a file finalized at interpreter exit)."""
    nvrx_utils = sys.modules.get("nvidia_resiliency_ext.fault_tolerance.utils")
    pickler = getattr(nvrx_utils, "_IPC_PICKLER", None)
    for referent in gc.get_referents(pickler) if pickler is not None else ():
        target = getattr(referent, "__self__", None)
        if isinstance(target, io.BufferedWriter):
            target.close()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Count each decoder's selected targets: they share its time in the long run."""
    for item in items:
        marker = item.get_closest_marker("fuzz")
        if marker is not None:
            _TARGETS_OF[marker.kwargs["decoder"]] += 1


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """In the long run (FTD_FUZZ_SECONDS), run a fuzz target round after round, fresh inputs
    each, for its share of its decoder's time; a line per target to FTD_FUZZ_REPORT."""
    marker = pyfuncitem.get_closest_marker("fuzz")
    if marker is None or not fuzzing.LONG_RUN_S:
        return None
    decoder = str(marker.kwargs["decoder"])
    share_s = fuzzing.LONG_RUN_S / max(1, _TARGETS_OF[decoder])
    args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    started = time.monotonic()
    rounds = 0
    while rounds == 0 or time.monotonic() - started < share_s:
        pyfuncitem.obj(**args)
        rounds += 1
    report = os.environ.get("FTD_FUZZ_REPORT")
    if report:
        line = {
            "decoder": decoder,
            "target": pyfuncitem.name,
            "rounds": rounds,
            "inputs": rounds * int(marker.kwargs["examples"]),
            "seconds": round(time.monotonic() - started, 1),
        }
        with open(report, "a") as out:
            out.write(json.dumps(line) + "\n")
    return True
