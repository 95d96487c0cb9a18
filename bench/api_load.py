"""`GET /v1/status` latency under load: an open-loop client at --rate requests/s against a
live `ftd serve` with --nproc ranks (heartbeating at --heartbeat-hz once ranks can).

    python bench/api_load.py --rate 500 --duration 20 --nproc 8 [--heartbeat-hz 100] \
        [--sse-subscribers 100]

Latency is measured from each request's scheduled send time (no coordinated omission): a
stalled server shows up in the tail instead of silently lowering the rate. With
--sse-subscribers N the same daemon is measured twice in one run: first with no event stream
open, then with N streams attached (each read by its own task). In both phases a timeout
change (`PATCH /v1/timeouts`, one event that every stream receives) goes out --patch-hz times
a second, and its latency is reported too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "heartbeat_worker.py"


async def start_daemon(
    log_dir: Path, nproc: int, heartbeat_hz: float
) -> asyncio.subprocess.Process:
    cmd = [
        sys.executable, "-m", "ftd", "serve",
        "--log-dir", str(log_dir), "--run-id", "bench", "--api-port", "0",
        "--nproc-per-node", str(nproc), "--log-level", "WARNING",
        str(WORKER), "--hz", str(heartbeat_hz),
    ]  # fmt: skip
    return await asyncio.create_subprocess_exec(*cmd, cwd=ROOT, stdin=asyncio.subprocess.DEVNULL)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (contention does not inflate it)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_token(path: str) -> str:
    return Path(path).read_text().strip()


async def wait_ready(run_dir: Path, daemon: asyncio.subprocess.Process) -> tuple[str, str]:
    api_file = run_dir / "api.json"
    async with aiohttp.ClientSession() as session:
        for _ in range(600):
            if daemon.returncode is not None:
                raise SystemExit(f"ftd serve exited with {daemon.returncode}")
            if api_file.exists():
                info = json.loads(api_file.read_text())
                async with session.get(info["url"] + "/readyz") as response:
                    if response.status == 200:
                        return info["url"], read_token(info["token_file"])
            await asyncio.sleep(0.1)  # start-up only: nothing to await across processes
    raise SystemExit("ftd serve did not get ready in 60 s")


async def patcher(url: str, token: str, hz: float, stop: asyncio.Event) -> list[float]:
    """`PATCH /v1/timeouts` `hz` times a second until `stop`: each is one event that every
    open stream receives. Their latencies."""
    latencies: list[float] = []
    if hz <= 0:
        return latencies
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        value = 0
        while not stop.is_set():
            value += 1
            began = time.perf_counter()
            body = {"rank_heartbeat_timeout": 1000 + value % 2}
            async with session.patch(url + "/v1/timeouts", json=body) as response:
                await response.read()
                assert response.status == 200, response.status
            latencies.append(time.perf_counter() - began)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1 / hz)  # the pace of the changes
    return latencies


class Subscribers:
    """N event streams, each read line by line by its own task; `events` counts what they
    received."""

    def __init__(self) -> None:
        self.events = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None

    async def open(self, url: str, token: str, count: int) -> None:
        connector = aiohttp.TCPConnector(limit=0)
        headers = {"Authorization": f"Bearer {token}", "Accept": "text/event-stream"}
        self._session = aiohttp.ClientSession(connector=connector, headers=headers)
        for _ in range(count):
            response = await self._session.get(url + "/v1/events")
            if response.status != 200:
                raise SystemExit(f"event stream refused: {response.status} {await response.text()}")
            await response.content.readline()  # the stream's first line: it is open
            self._tasks.append(asyncio.create_task(self._read(response)))

    async def _read(self, response: aiohttp.ClientResponse) -> None:
        with contextlib.suppress(aiohttp.ClientError, asyncio.CancelledError):
            while line := await response.content.readline():
                if line.startswith(b"event: "):
                    self.events += 1
        response.close()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()


async def load(url: str, token: str, rate: float, duration: float) -> tuple[list[float], int]:
    total = int(rate * duration)
    latencies: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=64)
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def one(scheduled: float) -> None:
            nonlocal errors
            try:
                async with session.get(url + "/v1/status") as response:
                    await response.read()
                    if response.status != 200:
                        errors += 1
            except aiohttp.ClientError:
                errors += 1
            latencies.append(time.perf_counter() - scheduled)

        # warm the connection pool
        await asyncio.gather(*(one(time.perf_counter()) for _ in range(16)))
        latencies.clear()
        start = time.perf_counter()
        tasks = []
        for i in range(total):
            scheduled = start + i / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(scheduled)))
        await asyncio.gather(*tasks)
    return latencies, errors


async def status_buckets(url: str, token: str) -> dict[str, float]:
    """The daemon's cumulative `/v1/status` handling-time histogram (le -> count)."""
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        aiohttp.ClientSession(headers=headers) as session,
        session.get(url + "/metrics") as response,
    ):
        text = await response.text()
    buckets: dict[str, float] = {}
    for line in text.splitlines():
        if (
            line.startswith("ftd_api_request_duration_seconds_bucket{")
            and 'route="/v1/status"' in line
        ):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[le] = float(line.rsplit(" ", 1)[1])
    return buckets


def server_shares(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Share of the `/v1/status` requests between two histogram readings that the server
    answered within each bucket: the server's own time, without the client's."""
    counts = {le: n - before.get(le, 0.0) for le, n in after.items()}
    total = counts.get("+Inf", 0.0) or 1.0
    return {
        f"<= {float(le) * 1000:g} ms": round(n / total, 4)
        for le, n in counts.items()
        if le != "+Inf"
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def phase(
    url: str, token: str, pid: int, args: argparse.Namespace, label: str
) -> dict[str, Any]:
    """One measured load: status latencies, timeout-change latencies, daemon CPU."""
    stop = asyncio.Event()
    buckets_before = await status_buckets(url, token)
    patches = asyncio.create_task(patcher(url, token, args.patch_hz, stop))
    cpu_before = cpu_seconds(pid)
    began = time.perf_counter()
    latencies, errors = await load(url, token, args.rate, args.duration)
    elapsed = time.perf_counter() - began
    daemon_cpu = cpu_seconds(pid) - cpu_before
    stop.set()
    patch_ms = [value * 1000 for value in await patches]
    server = server_shares(buckets_before, await status_buckets(url, token))
    ms = [value * 1000 for value in latencies]
    return {
        "phase": label,
        "requests": len(ms),
        "errors": errors,
        "rate_achieved": round(len(ms) / elapsed, 1),
        "p50_ms": round(percentile(ms, 50), 3),
        "p90_ms": round(percentile(ms, 90), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "max_ms": round(max(ms), 3),
        "mean_ms": round(statistics.fmean(ms), 3),
        "patches": len(patch_ms),
        "patch_p50_ms": round(percentile(patch_ms, 50), 3) if patch_ms else None,
        "patch_max_ms": round(max(patch_ms), 3) if patch_ms else None,
        "daemon_cpu_share": round(daemon_cpu / elapsed, 3),
        "load_average": os.getloadavg()[0],
        "server_share_within": server,
    }


def show(result: dict[str, Any], rate: float) -> None:
    patches = (
        f"; {result['patches']} timeout changes: p50 {result['patch_p50_ms']} ms, "
        f"max {result['patch_max_ms']} ms"
        if result["patches"]
        else ""
    )
    print(
        f"{result['phase']}: GET /v1/status at {result['rate_achieved']}/{rate:g} req/s: "
        f"p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms, max {result['max_ms']} ms, "
        f"{result['errors']} errors ({result['requests']} requests){patches}; daemon CPU "
        f"{result['daemon_cpu_share']:.0%} of a core, load average {result['load_average']:.1f}"
        + (
            f"; the streams received {result['stream_events_received']} events"
            if "stream_events_received" in result
            else ""
        )
    )
    shown = []
    for le, share in result["server_share_within"].items():
        shown.append(f"{share:.2%} {le}")
        if share >= 1:
            break
    within = ", ".join(shown)
    print(f"  server-side handling time (ftd_api_request_duration_seconds): {within or '-'}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=500.0, help="requests per second")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load")
    parser.add_argument("--nproc", type=int, default=8, help="ranks on the node")
    parser.add_argument(
        "--heartbeat-hz", type=float, default=0.0,
        help="each rank heartbeats this often (needs ftd_client.rank; 0: ranks only run)",
    )  # fmt: skip
    parser.add_argument(
        "--sse-subscribers", type=int, default=0,
        help="measure again with this many event streams attached (same daemon, same run)",
    )  # fmt: skip
    parser.add_argument(
        "--patch-hz", type=float, default=1.0,
        help="timeout changes per second during each phase (each is an event for every stream)",
    )  # fmt: skip
    parser.add_argument(
        "--warmup", type=float, default=10.0,
        help="seconds of unmeasured load first (the ranks and the daemon settle)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    phases: list[dict[str, Any]] = []
    subscribers = Subscribers()
    with tempfile.TemporaryDirectory(prefix="ftd-bench-") as tmp:
        daemon = await start_daemon(Path(tmp), args.nproc, args.heartbeat_hz)
        try:
            url, token = await wait_ready(Path(tmp) / "bench", daemon)
            if args.warmup > 0:
                await load(url, token, args.rate, args.warmup)
            phases.append(await phase(url, token, daemon.pid, args, "no event streams"))
            if args.sse_subscribers:
                await subscribers.open(url, token, args.sse_subscribers)
                label = f"{args.sse_subscribers} event streams"
                phases.append(await phase(url, token, daemon.pid, args, label))
                phases[-1]["stream_events_received"] = subscribers.events
        finally:
            await subscribers.close()
            if daemon.returncode is None:
                daemon.send_signal(signal.SIGTERM)
            await daemon.wait()
    result = {
        "rate_target": args.rate,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "ranks": args.nproc,
        "heartbeat_hz": args.heartbeat_hz,
        "phases": phases,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.nproc} ranks heartbeating at {args.heartbeat_hz:g} Hz, {result['machine']}")
        for one in phases:
            show(one, args.rate)


if __name__ == "__main__":
    import uvloop

    uvloop.run(main())
