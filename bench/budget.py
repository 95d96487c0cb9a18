"""Performance budget: ftd (default flags) against torchrun, measured in the same run on the same
machine; exits 1 when a ratio is past its budget (issue 41 item 2).

    PYTHONPATH=.:client python bench/budget.py [--quick] [--json OUT]
    python bench/budget.py --measurements OUT   # judge a recorded run's samples again

Every budget is a ratio (ftd's median over its peer's median), never an absolute time: the
peer runs in the same repetition, the order flipped every other one. The scenarios reuse the
harnesses beside this file:

- restart, spawn, start-up: zygote_restart.py's job (4 gloo CPU ranks; rank 1 crashes after
  the first allreduce of attempt 0) under `ftd serve` and under torchrun 2.13 with
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (its shared store wedges restarted gloo ranks,
  pytorch/pytorch#135712). Each rank also records when the kernel forked it
  (restart_worker.forked_at, 10 ms resolution): the launcher's own part of a restart is
  crash -> the last rank of the next attempt forked, measured the same way for both;
- hang overshoot: hang_detection.py's ftd run (its 2 ranks, ftd_client heartbeats every 10 ms,
  rank 1 silent): verdict logged - (last heartbeat + timeout), as a share of the timeout;
  torchrun has no verdict to compare with;
- idle: 4 ranks of this script heartbeating at 10 Hz (under torchrun the same loop without
  ftd_client, it has no socket); over a window, the CPU time and context switches of every
  thread of the launcher and its children that are not ranks (ftd: the daemon, its zygote and
  orphan guard; torchrun: its agent), and their PSS at its end.

For ftd, its events also split the launcher's part (informational, no budget): crash -> the
exit seen (`rank_exited`), -> the old ranks stopped (`workers_stopped`), -> the next attempt
started (`attempt_started`, its ranks forked). And each default-on feature that has a switch is
measured off beside the default flags in the same run (FEATURES_OFF; informational, no budget):
its cost is the difference.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import benchlib
import daemon_load
import hang_detection
import zygote_restart

THIS = Path(__file__).resolve()
FEATURES_OFF = {"progress": ("--progress", "off")}
"""Default-on features measured switched off beside the default flags (informational: a
feature's cost shows as a difference in one run). The memory tier costs nothing unless the
script calls it; paced reads and stragglers have no switch (stragglers ride on progress)."""
NPROC = 4
IDLE_HZ = 10.0
HANG_TIMEOUT_S = 2.0
RUN_LIMIT_S = 300.0
PEER_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
FINE_CPU = Path("/proc/self/sched").exists()


@dataclass(frozen=True)
class Budget:
    key: str
    figure: str
    unit: str
    peer: str
    limit: float
    """The largest ratio (ftd / peer, medians) that passes."""


BUDGETS = (
    Budget(
        "restart", "crash -> every rank's first allreduce, next attempt", "ms", "torchrun", 0.15
    ),
    Budget("spawn", "launcher's part: crash -> last rank forked", "ms", "torchrun", 0.60),
    Budget("hang_overshoot", "hang verdict past the deadline", "ms", "timeout", 0.02),
    Budget("idle_cpu", "idle CPU, launcher + non-rank children", "%", "torchrun", 2.0),
    Budget("idle_wakeups", "their wake-ups (context switches)", "/s", "torchrun", 1.0),
    Budget("pss", "PSS, launcher + non-rank children", "MiB", "torchrun", 1.0),
    Budget("startup", "clean start -> every rank's first allreduce", "ms", "torchrun", 0.70),
)


@dataclass(frozen=True)
class Verdict:
    budget: Budget
    ftd: list[float]
    peer: list[float]
    ratio: float
    passed: bool


def judge(samples: dict[str, dict[str, list[float]]]) -> list[Verdict]:
    """Each budget against `samples[key]` ({"ftd": [...], "peer": [...]}); a figure without
    samples on either side, or a peer median that is not positive, fails."""
    verdicts = []
    for budget in BUDGETS:
        ftd = samples.get(budget.key, {}).get("ftd", [])
        peer = samples.get(budget.key, {}).get("peer", [])
        ratio = float("inf")
        if ftd and peer and statistics.median(peer) > 0:
            ratio = statistics.median(ftd) / statistics.median(peer)
        verdicts.append(Verdict(budget, ftd, peer, ratio, ratio <= budget.limit))
    return verdicts


def table(verdicts: list[Verdict]) -> str:
    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.4g} / {max(values):.4g}" if values else "-"

    rows = [("figure", "unit", "ftd med / max", "peer med / max", "ratio", "budget", "")]
    rows += [
        (
            v.budget.figure,
            v.budget.unit,
            cell(v.ftd),
            f"{v.budget.peer} {cell(v.peer)}",
            f"{v.ratio:.3f}",
            f"<= {v.budget.limit:g}",
            "pass" if v.passed else "FAIL",
        )
        for v in verdicts
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


# -- the ranks ---------------------------------------------------------------------------------


def restart_rank(out: Path) -> None:
    """zygote_restart.py's rank, which also writes when the kernel forked it."""
    import restart_worker

    attempt, me = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
    (out / f"forked_a{attempt}_r{me}").write_text(repr(restart_worker.forked_at()))
    zygote_restart.rank(out)


def idle_rank(work: Path) -> None:
    """Beat at IDLE_HZ (through ftd_client under ftd) until `work/stop` exists."""
    client = None
    if "FTD_SOCKET" in os.environ:
        from ftd_client import RankClient

        client = RankClient()
    benchlib.write_atomic(work / f"ready_{os.environ['RANK']}", str(os.getpid()))
    next_beat = time.monotonic()
    while not (work / "stop").exists():
        if client is not None:
            client.heartbeat()
        next_beat += 1 / IDLE_HZ
        time.sleep(max(0.0, next_beat - time.monotonic()))


# -- the scenarios -----------------------------------------------------------------------------


def restart_run(launcher: str, flags: tuple[str, ...] = ()) -> dict[str, float]:
    """One run of zygote_restart.py's job with this script as the rank; ms. `flags`: ftd's
    extra serve flags (a default-on feature switched off)."""
    method = "zygote" if launcher == "ftd" else "torchrun"
    with tempfile.TemporaryDirectory(prefix=f"budget_{launcher}_") as tmp:
        out, log_dir = Path(tmp, "out"), Path(tmp, "logs")
        out.mkdir()
        swap = {
            str(Path(zygote_restart.__file__).resolve()): str(THIS),
            "--as-rank": "--as-restart",
        }
        cmd = [swap.get(p, p) for p in zygote_restart.command(method, NPROC, out, log_dir)]
        if flags:
            at = cmd.index("serve") + 1
            cmd[at:at] = flags
        launched = time.time()
        with open(Path(tmp, "launcher.log"), "wb") as log:
            code = subprocess.run(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=benchlib.child_env() | PEER_ENV,
                timeout=RUN_LIMIT_S,
                check=False,
            ).returncode
        if code != 0:
            raise SystemExit(f"{launcher} exited {code}:\n{Path(tmp, 'launcher.log').read_text()}")

        def last(mark: str) -> float:
            return max(float(out.joinpath(f"{mark}_r{r}").read_text()) for r in range(NPROC))

        crash = float(out.joinpath("crash").read_text())
        figures = {
            "restart": 1000 * (last("allreduce_a1") - crash),
            "spawn": 1000 * (last("forked_a1") - crash),
            "startup": 1000 * (last("allreduce_a0") - launched),
        }
        if launcher == "ftd":
            figures |= ftd_stages(log_dir / "bench", crash)
        return figures


FTD_STAGES = (
    ("ftd_exit_seen", "rank_exited", 0),
    ("ftd_old_ranks_stopped", "workers_stopped", 0),
    ("ftd_attempt_started", "attempt_started", 1),
)


def ftd_stages(run_dir: Path, crash: float) -> dict[str, float]:
    """ms from the crash to the first event of each stage (informational)."""
    stages = {}
    events = benchlib.events(run_dir)
    for key, kind, attempt in FTD_STAGES:
        times = [e["time"] for e in events if e["kind"] == kind and e["data"]["attempt"] == attempt]
        stages[key] = 1000 * (float(times[0]) - crash)
    return stages


def hang_run(work: Path) -> float:
    """hang_detection.py's ftd run: the verdict's overshoot past the deadline, ms."""
    args = argparse.Namespace(timeout=HANG_TIMEOUT_S, initial=None)
    try:
        run = hang_detection.run_once(hang_detection.Setup("ftd", "ftd"), work, args)
    except hang_detection.RunFailed as error:
        raise SystemExit(f"hang run: {error}; see {work}") from None
    return run[hang_detection.VERDICT]


def measured(launcher: int, ranks: set[int]) -> list[int]:
    """The launcher and its descendants, but for the ranks and what is below them."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # a process that ended meanwhile
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    kept, todo = [], [launcher]
    while todo:
        pid = todo.pop()
        if pid not in ranks:
            kept.append(pid)
            todo += children.get(pid, [])
    return kept


def cpu_s(pid: int) -> float:
    """CPU time of every thread of `pid`: the scheduler's ns counts where the kernel has them
    (/proc/<pid>/task/<tid>/sched), daemon_load's utime + stime ticks (10 ms) elsewhere."""
    if not FINE_CPU:
        return daemon_load.cpu_seconds(pid)
    total_ms = 0.0
    for text in task_files(pid, "sched"):
        for line in text.splitlines():
            if line.startswith("se.sum_exec_runtime"):
                total_ms += float(line.split(":")[1])
    return total_ms / 1000


def task_files(pid: int, name: str) -> list[str]:
    """`name` of each thread of `pid`; a thread that ended meanwhile is left out."""
    texts = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            texts.append((task / name).read_text())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return texts


def switches(pid: int) -> int:
    total = 0
    for text in task_files(pid, "status"):
        for line in text.splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                total += int(line.split()[1])
    return total


def pss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no Pss in /proc/{pid}/smaps_rollup")


def idle_run(launcher: str, work: Path, window_s: float) -> dict[str, float]:
    script = [str(THIS), "--as-idle", str(work)]
    ranks = ["--nproc-per-node", str(NPROC)]
    if launcher == "ftd":
        proc = benchlib.serve(work, "idle", THIS, script[1:], *ranks)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", *ranks, *script]
        with open(work / "torchrun.out", "wb") as log:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=benchlib.child_env() | PEER_ENV,
                start_new_session=True,
            )
    try:
        rank_pids = {int(benchlib.wait_for(work / f"ready_{r}", 120)) for r in range(NPROC)}
        time.sleep(1.0)  # past the ranks' connections and the daemon's first look at them
        pids = measured(proc.pid, rank_pids)
        t0, cpu0 = time.monotonic(), sum(cpu_s(p) for p in pids)
        switched0 = sum(switches(p) for p in pids)
        time.sleep(window_s)
        elapsed = time.monotonic() - t0
        cpu = sum(cpu_s(p) for p in pids) - cpu0
        switched = sum(switches(p) for p in pids) - switched0
        pss = sum(pss_mib(p) for p in pids)
        benchlib.write_atomic(work / "stop", "1")
        if proc.wait(timeout=60) != 0:
            raise SystemExit(f"{launcher} exited {proc.returncode}; see {work}")
    finally:
        if proc.poll() is None:
            if launcher == "ftd":
                proc.kill()  # its orphan guard takes the ranks down
            else:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return {
        "idle_cpu": 100 * cpu / elapsed,
        "idle_wakeups": switched / elapsed,
        "pss": pss,
        "processes": float(len(pids)),
    }


def alternated(repeats: int) -> list[tuple[int, str, str]]:
    """(repetition, launcher, side of the samples), the order flipped every other repetition."""
    pairs = [("ftd", "ftd"), ("torchrun", "peer")]
    return [(i, *pair) for i in range(repeats) for pair in (pairs if i % 2 == 0 else pairs[::-1])]


def measure(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    samples: dict[str, dict[str, list[float]]] = {b.key: {"ftd": [], "peer": []} for b in BUDGETS}
    root = benchlib.fresh_dir(Path(args.work_dir))
    for index, launcher, side in alternated(args.repeats):
        figures = restart_run(launcher)
        for key, value in figures.items():
            samples.setdefault(key, {"ftd": [], "peer": []})[side].append(value)
        print(f"restart {index} {launcher}: {figures}", flush=True)
    for index in range(args.off_repeats):  # each default-on feature's cost, in the same run
        for feature, flags in FEATURES_OFF.items():
            figures = restart_run("ftd", flags)
            for key in ("restart", "spawn", "startup"):
                samples.setdefault(f"{feature}_off:{key}", {"ftd": [], "peer": []})["ftd"].append(
                    figures[key]
                )
            print(f"restart {index} ftd {' '.join(flags)}: {figures}", flush=True)
    for index in range(args.hang_repeats):
        overshoot = hang_run(benchlib.fresh_dir(root / f"hang{index}"))
        samples["hang_overshoot"]["ftd"].append(overshoot)
        samples["hang_overshoot"]["peer"].append(1000 * HANG_TIMEOUT_S)
        print(f"hang {index}: verdict {overshoot:.1f} ms past the deadline", flush=True)
    for index, launcher, side in alternated(args.idle_repeats):
        work = benchlib.fresh_dir(root / f"idle{index}_{launcher}")
        figures = idle_run(launcher, work, args.window)
        for key in ("idle_cpu", "idle_wakeups", "pss"):
            samples[key][side].append(figures[key])
        print(f"idle {index} {launcher}: {figures}", flush=True)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 restarts, 1 hang, 1 idle of 10 s")
    parser.add_argument("--repeats", type=int, default=5, help="restart runs per launcher")
    parser.add_argument("--hang-repeats", type=int, default=3)
    parser.add_argument(
        "--off-repeats", type=int, default=3, help="restart runs per feature switched off"
    )
    parser.add_argument("--idle-repeats", type=int, default=2)
    parser.add_argument("--window", type=float, default=20.0, help="idle window (s)")
    parser.add_argument("--work-dir", default="/tmp/ftd-bench/budget")
    parser.add_argument("--json", type=Path, help="write the samples and verdicts here")
    parser.add_argument("--measurements", type=Path, help="judge this --json file's samples")
    parser.add_argument("--as-restart", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--as-idle", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_restart is not None:
        return restart_rank(args.as_restart)
    if args.as_idle is not None:
        return idle_rank(args.as_idle)
    if args.quick:
        args.repeats, args.hang_repeats, args.idle_repeats, args.window = 2, 1, 1, 10.0
        args.off_repeats = 1
    results: dict[str, Any]
    if args.measurements is not None:
        results = json.loads(args.measurements.read_text())
    else:
        info = benchlib.machine()
        samples = measure(args)
        info["loadavg at end"] = benchlib._read("/proc/loadavg")
        results = {"command": [sys.executable, *sys.argv], "machine": info, "samples": samples}
        benchlib.print_machine(info)
    verdicts = judge(results["samples"])
    print(table(verdicts))
    for key, sides in results["samples"].items():
        if key.startswith("ftd_") and (got := sides["ftd"]):
            print(f"ftd, crash -> {key[4:]}: {statistics.median(got):.0f} / {max(got):.0f} ms")
        elif "_off:" in key and (got := sides["ftd"]):
            feature, figure = key.split("_off:")
            on = statistics.median(results["samples"][figure]["ftd"])
            off = statistics.median(got)
            print(
                f"ftd {' '.join(FEATURES_OFF.get(feature, ()))}, {figure}: {off:.0f} / "
                f"{max(got):.0f} ms (default flags: {on:.0f} ms; the feature costs {on - off:+.0f})"
            )
    results["verdicts"] = {
        v.budget.key: {"ratio": v.ratio, "limit": v.budget.limit, "passed": v.passed}
        for v in verdicts
    }
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    broken = [v.budget.key for v in verdicts if not v.passed]
    if broken:
        print(f"budget broken: {', '.join(broken)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
