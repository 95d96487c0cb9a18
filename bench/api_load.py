"""`GET /v1/status` latency under load: an open-loop client at --rate requests/s against a
live `ftd serve` with --nproc ranks (heartbeating at --heartbeat-hz once ranks can).

    python bench/api_load.py --rate 500 --duration 20 --nproc 8 [--heartbeat-hz 100]

Latency is measured from each request's scheduled send time (no coordinated omission): a
stalled server shows up in the tail instead of silently lowering the rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

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


async def server_side(url: str, token: str) -> dict[str, float]:
    """Share of `/v1/status` requests the server answered within each histogram bucket
    (ftd_api_request_duration_seconds): the server's own time, without the client's."""
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
    total = buckets.get("+Inf", 0.0) or 1.0
    return {
        f"<= {float(le) * 1000:g} ms": round(n / total, 4)
        for le, n in buckets.items()
        if le != "+Inf"
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=500.0, help="requests per second")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load")
    parser.add_argument("--nproc", type=int, default=8, help="ranks on the node")
    parser.add_argument(
        "--heartbeat-hz", type=float, default=0.0,
        help="each rank heartbeats this often (needs ftd_client.rank; 0: ranks only run)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ftd-bench-") as tmp:
        daemon = await start_daemon(Path(tmp), args.nproc, args.heartbeat_hz)
        try:
            url, token = await wait_ready(Path(tmp) / "bench", daemon)
            cpu_before = cpu_seconds(daemon.pid)
            began = time.perf_counter()
            latencies, errors = await load(url, token, args.rate, args.duration)
            elapsed = time.perf_counter() - began
            daemon_cpu = cpu_seconds(daemon.pid) - cpu_before
            server = await server_side(url, token)
        finally:
            if daemon.returncode is None:
                daemon.send_signal(signal.SIGTERM)
            await daemon.wait()
    ms = [value * 1000 for value in latencies]
    result = {
        "requests": len(ms),
        "errors": errors,
        "rate_target": args.rate,
        "rate_achieved": round(len(ms) / elapsed, 1),
        "ranks": args.nproc,
        "heartbeat_hz": args.heartbeat_hz,
        "p50_ms": round(percentile(ms, 50), 3),
        "p90_ms": round(percentile(ms, 90), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "max_ms": round(max(ms), 3),
        "mean_ms": round(statistics.fmean(ms), 3),
        "server_share_within": server,
        "daemon_cpu_share": round(daemon_cpu / elapsed, 3),
        "load_average": os.getloadavg()[0],
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"GET /v1/status at {result['rate_achieved']}/{args.rate:g} req/s, {args.nproc} ranks"
            f" (heartbeat {args.heartbeat_hz:g} Hz): p50 {result['p50_ms']} ms, p99 "
            f"{result['p99_ms']} ms, max {result['max_ms']} ms, {errors} errors"
            f" ({len(ms)} requests)"
        )
        within = ", ".join(f"{share:.2%} {le}" for le, share in server.items() if share < 1)
        print(f"server-side handling time (ftd_api_request_duration_seconds): {within}")
        print(
            f"daemon CPU: {result['daemon_cpu_share']:.0%} of one core "
            f"(load average {result['load_average']:.1f} on {os.cpu_count()} CPUs)"
        )


if __name__ == "__main__":
    import uvloop

    uvloop.run(main())
