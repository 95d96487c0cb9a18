"""How late a silent rank is judged, killed, and its group back at work, under ftd and beside
NVIDIA's ft_launcher.

    python bench/hang_detection.py [--repeats 7] [--timeout 0.5] [--initial S]
    python bench/hang_detection.py --initial 30 --timeout 2 --launcher ftd ft_launcher \\
        --client ftd nvrx --workload-check-interval 5 0.01

Each repetition runs every setup once, the order reversed every other repetition, each in a
directory of its own. A setup is a launcher and the client its rank script heartbeats with:

* `ftd serve` with ftd_client's `RankClient` (`--client ftd`), or with NVRx's own
  `RankMonitorClient` (`--client nvrx`: ftd serves NVRx's protocol);
* `ft_launcher` (nvidia-resiliency-ext) with NVRx's `RankMonitorClient`, once per
  `--workload-check-interval` (how often its rank monitors look at their rank; NVRx's default
  is 5 s).

Both launchers run `--nproc-per-node 2 --max-restarts 1` with the same timeouts
(`rank_heartbeat_timeout=--timeout`, `initial_rank_heartbeat_timeout=--initial` when given).
Attempt 0: both ranks join a gloo group, do one allreduce, then heartbeat every 10 ms; after
1 s rank 1 goes silent and writes the wall time of its last heartbeat (taken when the call
returned: NVRx's heartbeat is a round trip, ftd_client's a one-way send) and its pid. Attempt 1:
both ranks import torch, join a new gloo group, do one allreduce and write the time it finished.

With t0 = last heartbeat + timeout (the earliest moment a verdict is due), per repetition, in
ms after t0 (wall clock, the clock of the launchers' logs and ftd's `events.jsonl`):

* verdict logged: ftd's "hung:" error line; ft_launcher's rank monitor's "Did not get
  subsequent heartbeat" warning (both written when the verdict is reached, 1 ms resolution);
* ftd only: its own "overdue by" figure (its monotonic clock, from the receipt of the last
  heartbeat) and the `rank_hung` event (written after the stack dump, just before the kill);
* silent rank dead: this script waits on the rank's pidfd (the same watch for every launcher);
* failure seen by the launcher: ftd's `rank_exited` event (`ended_at`); ft_launcher's
  "failed (exitcode: -9)" line (its agent polls its ranks every `--monitor-interval`, 0.1 s);
* back at work: the last attempt-1 rank to finish its first allreduce, with the steps between.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import benchlib

STARTED = time.time()
INTERVAL_S = 0.01
SILENT_AFTER_S = 1.0
BAD_RANK = 1
FLOOR_ENV = "FTD_BENCH_FLOOR"
RUN_LIMIT_S = 300.0
NVRX_DEFAULT_CHECK_S = 5.0


@dataclass(frozen=True)
class Setup:
    launcher: str  # "ftd" or "ft_launcher"
    client: str  # "ftd" (ftd_client) or "nvrx" (NVRx's RankMonitorClient)
    check_interval_s: float = NVRX_DEFAULT_CHECK_S  # ft_launcher's workload_check_interval

    @property
    def name(self) -> str:
        if self.launcher == "ftd":
            return "ftd + " + ("ftd_client" if self.client == "ftd" else "NVRx client")
        return f"ft_launcher (checks every {self.check_interval_s:g} s)"

    @property
    def slug(self) -> str:
        if self.launcher == "ftd":
            return f"ftd_{self.client}"
        return f"ft_launcher_{self.check_interval_s:g}s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="repetitions of every setup")
    parser.add_argument("--timeout", type=float, default=0.5, help="rank_heartbeat_timeout (s)")
    parser.add_argument(
        "--initial", type=float, default=None, help="initial_rank_heartbeat_timeout (s)"
    )
    parser.add_argument("--launcher", nargs="+", choices=("ftd", "ft_launcher"), default=["ftd"])
    parser.add_argument(
        "--client", nargs="+", choices=("ftd", "nvrx"), default=["ftd"],
        help="the ranks' heartbeat client under ftd (ft_launcher's ranks use NVRx's)",
    )  # fmt: skip
    parser.add_argument(
        "--workload-check-interval", nargs="+", type=float, default=[NVRX_DEFAULT_CHECK_S],
        help="ft_launcher's --ft-workload-check-interval, one setup each (s)",
    )  # fmt: skip
    parser.add_argument("--no-floor", action="store_true", help="skip the plain-process floor")
    parser.add_argument("--work-dir", default="/tmp/ftd-bench/hang_detection")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--rank-client", choices=("ftd", "nvrx"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if os.environ.get(FLOOR_ENV):
        recover(Path(args.work_dir), int(os.environ["RANK"]), linger=True)
    elif args.rank_client:
        rank_main(Path(args.work_dir), args.rank_client)
    else:
        launch(args)


# -- the rank ----------------------------------------------------------------------------------


def rank_main(work: Path, client: str) -> None:
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0:
        misbehave(work, rank, client)
    else:
        recover(work, rank)


def heartbeat_call(client: str) -> Callable[[], None]:
    if client == "nvrx":
        from nvidia_resiliency_ext.fault_tolerance import (  # type: ignore[import-untyped]
            RankMonitorClient,
        )

        monitor = RankMonitorClient()
        monitor.init_workload_monitoring()
        return monitor.send_heartbeat  # type: ignore[no-any-return]
    from ftd_client import RankClient

    return RankClient().heartbeat


def misbehave(work: Path, rank: int, client: str) -> None:
    import torch
    import torch.distributed as dist

    heartbeat = heartbeat_call(client)
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    silent_at = time.monotonic() + SILENT_AFTER_S
    next_beat = time.monotonic()
    while True:
        heartbeat()
        sent = time.time()
        if rank == BAD_RANK and time.monotonic() >= silent_at:
            last = {"time": sent, "pid": os.getpid()}
            benchlib.write_atomic(work / "last_heartbeat", json.dumps(last))
            time.sleep(3600)
        next_beat += INTERVAL_S
        time.sleep(max(0.0, next_beat - time.monotonic()))


def recover(work: Path, rank: int, linger: bool = False) -> None:
    marks = {"interpreter_up": STARTED}
    import torch
    import torch.distributed as dist

    marks["torch_imported"] = time.time()
    dist.init_process_group("gloo")
    marks["group_joined"] = time.time()
    dist.all_reduce(torch.ones(1))
    marks["allreduce_done"] = time.time()
    if linger:  # the floor: stay in the group, as attempt 0's ranks do, until killed
        benchlib.write_atomic(work / f"floor_{rank}.json", json.dumps(marks))
        time.sleep(3600)
    dist.destroy_process_group()
    benchlib.write_atomic(work / f"recovered_{rank}.json", json.dumps(marks))


# -- the launchers -----------------------------------------------------------------------------


class RunFailed(RuntimeError):
    pass


def setups(args: argparse.Namespace) -> list[Setup]:
    chosen: list[Setup] = []
    for launcher in dict.fromkeys(args.launcher):
        if launcher == "ftd":
            chosen += [Setup("ftd", client) for client in dict.fromkeys(args.client)]
        else:
            intervals = dict.fromkeys(args.workload_check_interval)
            chosen += [Setup("ft_launcher", "nvrx", s) for s in intervals]
    return chosen


def launch(args: argparse.Namespace) -> None:
    root = benchlib.fresh_dir(Path(args.work_dir))
    info = benchlib.machine()
    chosen = setups(args)
    runs: dict[str, list[dict[str, float]]] = {setup.name: [] for setup in chosen}
    floors: list[dict[str, float]] = []
    loads: list[float] = []
    for repeat in range(args.repeats):
        for setup in chosen if repeat % 2 == 0 else chosen[::-1]:
            work = benchlib.fresh_dir(root / f"r{repeat}_{setup.slug}")
            loads.append(os.getloadavg()[0])
            try:
                run = run_once(setup, work, args)
            except RunFailed as error:
                raise SystemExit(f"repeat {repeat}, {setup.name}: {error}; see {work}") from None
            runs[setup.name].append(run)
            print(f"repeat {repeat} {setup.name}: {describe(run)}", flush=True)
        if not args.no_floor:
            floors.append(floor(benchlib.fresh_dir(root / f"r{repeat}_floor")))
            print(f"repeat {repeat} floor: {describe(floors[-1])}", flush=True)
    info["loadavg at end"] = benchlib._read("/proc/loadavg")
    results = {
        "command": [sys.executable, *sys.argv],
        "timeout_s": args.timeout,
        "initial_s": args.initial,
        "setups": [setup.name for setup in chosen],
        "runs": runs,
        "floor": floors,
        "load_1min_before_each_run": loads,
        "machine": info,
    }
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def describe(run: dict[str, float]) -> str:
    return ", ".join(f"{key} {value:.1f}" for key, value in run.items())


def timeout_flags(args: argparse.Namespace, setup: Setup) -> list[str]:
    flags = [f"--ft-param-rank_heartbeat_timeout={args.timeout}"]
    if args.initial is not None:
        flags.append(f"--ft-param-initial_rank_heartbeat_timeout={args.initial}")
    if setup.launcher == "ft_launcher":
        flags.append(f"--ft-param-workload_check_interval={setup.check_interval_s}")
    return flags


def start(setup: Setup, work: Path, args: argparse.Namespace) -> subprocess.Popen[bytes]:
    script = [str(Path(__file__).resolve()), "--work-dir", str(work), "--rank-client", setup.client]
    common = ["--nproc-per-node", "2", "--max-restarts", "1", *timeout_flags(args, setup)]
    if setup.launcher == "ftd":
        return benchlib.serve(work, "hang", Path(script[0]), script[1:], *common)
    ft_launcher = Path(sys.executable).with_name("ft_launcher")
    if not ft_launcher.exists():
        raise SystemExit(f"{ft_launcher} not found: install the nvrx extra (make .venv/.installed)")
    cmd = [str(ft_launcher), "--standalone", *common, *script]
    out = (work / "ft_launcher.out").open("wb")
    err = (work / "ft_launcher.err").open("wb")
    return subprocess.Popen(
        cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=benchlib.child_env(),
        start_new_session=True,
    )  # fmt: skip


def run_once(setup: Setup, work: Path, args: argparse.Namespace) -> dict[str, float]:
    proc = start(setup, work, args)
    try:
        dead = watch_silent_rank(work, proc)
        code = proc.wait(timeout=RUN_LIMIT_S)
    except subprocess.TimeoutExpired:
        raise RunFailed(f"{setup.launcher} still running after {RUN_LIMIT_S:.0f}s") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if code != 0:
        raise RunFailed(f"{setup.launcher} exited {code}")
    last = json.loads((work / "last_heartbeat").read_text())
    t0 = float(last["time"]) + args.timeout
    figures: dict[str, float] = {}
    if setup.launcher == "ftd":
        at, figures[OVERDUE] = ftd_marks(work, int(last["pid"]))
    else:
        at = ft_launcher_marks(work)
    at["silent rank dead (pidfd)"] = dead
    marks = [json.loads((work / f"recovered_{r}.json").read_text()) for r in (0, 1)]
    for key, label in RECOVERY_MARKS:
        at[label] = max(m[key] for m in marks)
    return {label: 1000 * (at[label] - t0) for label in STEPS if label in at} | figures


def watch_silent_rank(work: Path, proc: subprocess.Popen[bytes]) -> float:
    """When the silent rank died (wall clock), watched through its pidfd from here."""
    path = work / "last_heartbeat"
    deadline = time.monotonic() + RUN_LIMIT_S
    while not path.exists():
        if proc.poll() is not None:
            raise RunFailed(f"the launcher exited {proc.returncode} before rank 1 went silent")
        if time.monotonic() > deadline:
            raise RunFailed(f"rank 1 did not go silent within {RUN_LIMIT_S:.0f}s")
        time.sleep(0.01)
    pid = int(json.loads(path.read_text())["pid"])
    try:
        gone = benchlib.wait_gone(pid, RUN_LIMIT_S)
    except ProcessLookupError:
        raise RunFailed(f"rank 1 (pid {pid}) was gone before its pidfd was opened") from None
    if gone is None:
        raise RunFailed(f"rank 1 (pid {pid}) still alive after {RUN_LIMIT_S:.0f}s")
    return gone


# Row labels, in order; the values are ms after t0 except where a label says otherwise.
VERDICT = "verdict logged"
OVERDUE = "verdict: ftd's own 'overdue by' (its clock)"
STEPS = (
    VERDICT,
    "rank_hung event (after the stack dump)",
    "silent rank dead (pidfd)",
    "launcher saw the rank gone",
    "attempt 1 started (ftd)",
    "attempt 1 interpreters up",
    "attempt 1 torch imported",
    "attempt 1 gloo group joined",
    "attempt 1 first allreduce done",
)
RECOVERY_MARKS = (
    ("interpreter_up", "attempt 1 interpreters up"),
    ("torch_imported", "attempt 1 torch imported"),
    ("group_joined", "attempt 1 gloo group joined"),
    ("allreduce_done", "attempt 1 first allreduce done"),
)
FTD_LOG_TIME = re.compile(r"^\[ftd \w (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
NVRX_LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\] ")


def log_time(pattern: re.Pattern[str], path: Path, needle: str) -> float:
    """The local-time stamp (logging's asctime) of the first line of `path` holding `needle`."""
    for line in path.read_text(errors="replace").splitlines():
        match = pattern.match(line)
        if match is not None and needle in line:
            return datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    raise RunFailed(f"no line with {needle!r} in {path}")


def ftd_marks(work: Path, silent_pid: int) -> tuple[dict[str, float], float]:
    """ftd's milestones (wall clock) and its own "overdue by" figure (ms)."""
    events = benchlib.events(work / "hang")
    [hung] = [e for e in events if e["kind"] == "rank_hung"]
    if hung["data"]["pid"] != silent_pid:
        raise RunFailed(f"ftd judged pid {hung['data']['pid']}, not the silent {silent_pid}")
    overdue = re.search(r"overdue by ([0-9.]+) ms", hung["data"]["reason"])
    if overdue is None:
        raise RunFailed(f"no 'overdue by' in {hung['data']['reason']!r}")
    [exited] = [e for e in events if e["kind"] == "rank_exited" and e["data"]["pid"] == silent_pid]
    [started] = [e for e in events if e["kind"] == "attempt_started" and e["data"]["attempt"] == 1]
    at = {
        VERDICT: log_time(FTD_LOG_TIME, work / "hang.err", f"pid {silent_pid}) hung:"),
        "rank_hung event (after the stack dump)": hung["time"],
        "launcher saw the rank gone": exited["data"]["ended_at"],
        "attempt 1 started (ftd)": started["time"],
    }
    return at, float(overdue.group(1))


def ft_launcher_marks(work: Path) -> dict[str, float]:
    err = work / "ft_launcher.err"
    return {
        VERDICT: log_time(NVRX_LOG_TIME, err, "Did not get subsequent heartbeat"),
        "launcher saw the rank gone": log_time(NVRX_LOG_TIME, err, "failed (exitcode"),
    }


def floor(work: Path) -> dict[str, float]:
    """Without a launcher, between repetitions: two plain processes started at once doing what
    attempt 1 does (the cost of any restart), then one SIGKILLed and reaped (the cost of any
    kill of a rank holding torch and a gloo group)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = {**benchlib.child_env(), FLOOR_ENV: "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}  # fmt: skip
    spawned = time.time()
    procs = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--work-dir", str(work)],
            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
        )
        for rank in (0, 1)
    ]
    try:
        marks = [json.loads(benchlib.wait_for(work / f"floor_{r}.json", 120)) for r in (0, 1)]
        killed = time.time()
        procs[1].kill()
        procs[1].wait()
        reaped = time.time()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return {
        "plain start to first allreduce": 1000
        * (max(m["allreduce_done"] for m in marks) - spawned),
        "SIGKILL to reaped": 1000 * (reaped - killed),
    }


# -- the report --------------------------------------------------------------------------------


def cell(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def report(results: dict[str, Any]) -> None:
    benchlib.print_machine(results["machine"])
    runs: dict[str, list[dict[str, float]]] = results["runs"]
    loads = results["load_1min_before_each_run"]
    initial = results["initial_s"]
    print(
        f"# {min(len(r) for r in runs.values())} repetitions per setup, "
        f"rank_heartbeat_timeout={results['timeout_s']}s"
        + (f", initial_rank_heartbeat_timeout={initial}s" if initial is not None else "")
        + f", heartbeats every {1000 * INTERVAL_S:.0f} ms; 1-minute load before the runs "
        f"{min(loads):.2f}-{max(loads):.2f} (median {statistics.median(loads):.2f})"
    )
    print("# ms after last heartbeat + timeout: median [min-max]")
    names = results["setups"]
    print("| step | " + " | ".join(names) + " |")
    print("| --- |" + " ---: |" * len(names))
    for label in (STEPS[0], OVERDUE, *STEPS[1:]):
        cells = [cell([run[label] for run in runs[name] if label in run]) for name in names]
        if any(c != "-" for c in cells):
            print(f"| {label} | " + " | ".join(cells) + " |")
    for key in results["floor"][0] if results["floor"] else ():
        values = [f[key] for f in results["floor"]]
        print(f"# floor, no launcher, between repetitions: {key}: {cell(values)} ms")
    timeout_ms = 1000 * results["timeout_s"]
    ftd_names = [n for n in names if n.startswith("ftd")]
    for name in names:
        late = [run[VERDICT] for run in runs[name]]
        print(
            f"# {name}: verdict {statistics.median(late):.1f} ms (median), {max(late):.1f} ms "
            f"(max) after last heartbeat + timeout; within 20 ms: {max(late) <= 20}"
        )
        for ftd_name in ftd_names if name not in ftd_names else ():
            ftd_late = [run[VERDICT] for run in runs[ftd_name]]
            print(f"#   / {ftd_name}: {ratios(late, ftd_late, timeout_ms)}")


def ratios(late: list[float], ftd_late: list[float], timeout_ms: float) -> str:
    """Lateness against lateness, and silence-to-verdict against silence-to-verdict."""
    parts = []
    for what, stat in (("median", statistics.median), ("max", max)):
        a, b = stat(late), stat(ftd_late)
        lateness = f"{a / b:.0f}x" if b > 0 else "inf"
        parts.append(
            f"{what}: lateness {lateness}, last heartbeat -> verdict "
            f"{(timeout_ms + a) / (timeout_ms + b):.2f}x"
        )
    return "; ".join(parts)


if __name__ == "__main__":
    main()
