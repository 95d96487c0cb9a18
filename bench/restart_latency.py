"""Restart latency: ftd serve against torchrun, alternated in one run (issue 2).

A job of `--nproc` gloo ranks on CPU (bench/restart_worker.py) crashes at a known point of
attempt 0: rank 1 exits 1 once every rank is past its first allreduce. Measured, for each
launcher, from the failing rank's death to the moment every rank of attempt 1 has finished its
first allreduce, broken down by phase. Phases are the latest rank's (max over ranks), since the
job can go on only when the last one is there.

    PYTHONPATH=.:client python bench/restart_latency.py --pairs 5 --ftd-args="--start-method spawn"
    PYTHONPATH=.:client python bench/restart_latency.py --pairs 5   # the default: zygote

Each pair runs both launchers, the order alternating from pair to pair; each run has its own
temporary directory. Every timestamp is wall-clock `time.time()` on this machine, so the ranks'
marks, the failing rank's death and ftd's event log (`events.jsonl`) share one clock.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import benchlib

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
WORKER = BENCH_DIR / "restart_worker.py"
LAUNCHERS = ("ftd", "torchrun")
FAIL_RANK = 1

# (key, label): milestones after the failing rank's death, in order. The launcher's own ones
# come from ftd's event log, or from torchrun's log lines (1 ms resolution; see FOOTNOTES); the
# ranks' ones from the marks every rank of attempt 1 writes (max over the ranks).
LAUNCHER_PHASES = (
    ("detected", "death -> failure detected [1]"),
    ("old_exited", "  -> last old rank exited [2]"),
    ("old_gone", "  -> old ranks gone [3]"),
    ("attempt_started", "  -> new ranks spawned [4]"),
)
RANK_PHASES = (
    ("forked", "death -> last new rank forked (10 ms res.)"),
    ("t0", "  -> last new rank's script started"),
    ("torch_imported", "  -> torch imported"),
    ("pg_up", "  -> process group up"),
    ("allreduce", "  -> first allreduce done (TOTAL)"),
)

FOOTNOTES = """\
[1] ftd: its rank_exited event for the failing pid; torchrun: its first "closing signal" line
[2] ftd: the last rank_exited event of attempt 0 (the others, after SIGTERM)
[3] ftd: workers_stopped of attempt 0 (strays swept, logs closed); torchrun: its
    "failed (exitcode" line, logged once every old rank has exited
[4] ftd: attempt_started of attempt 1, once every new rank's process exists: ftd's own part
"forked" is the kernel's start time of the new rank process; "script started" adds the Python
interpreter's start-up (the same interpreter and flags under both launchers)."""


@dataclass
class RunResult:
    launcher: str
    pair: int
    position: int  # 0: ran first in its pair
    wall_s: float
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds from the failing rank's death to each milestone."""


class RunFailed(RuntimeError):
    pass


def launcher_command(
    launcher: str, args: argparse.Namespace, run_dir: Path, out_dir: Path
) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    paths = [str(REPO_DIR), str(REPO_DIR / "client")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    worker = [str(WORKER), "--out", str(out_dir), "--fail-rank", str(FAIL_RANK)]
    nproc = str(args.nproc)
    if launcher == "ftd":
        cmd = [
            args.python,
            "-m",
            "ftd",
            "serve",
            "--log-dir",
            str(run_dir / "logs"),
            "--run-id",
            "bench",
            "--nproc-per-node",
            nproc,
            "--max-restarts",
            "1",
            "--api-port",
            "off",
            *shlex.split(args.ftd_args),
            *worker,
        ]
    else:
        # torchrun's own restarts only work with a store per attempt (pytorch/pytorch#135712).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        cmd = [
            args.python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            nproc,
            "--max-restarts",
            "1",
            "--log-dir",
            str(run_dir / "logs"),
            *shlex.split(args.torchrun_args),
            *worker,
        ]
    return cmd, env


def run_launcher(launcher: str, args: argparse.Namespace, run_dir: Path) -> float:
    """Run one job to completion (bounded); its wall time. Raises RunFailed."""
    out_dir = run_dir / "out"
    out_dir.mkdir(parents=True)
    cmd, env = launcher_command(launcher, args, run_dir, out_dir)
    log_path = run_dir / "launcher.log"
    start = time.monotonic()
    watcher = threading.Thread(target=watch_doomed_rank, args=(out_dir,), daemon=True)
    watcher.start()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=run_dir,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_session(proc)
            raise RunFailed(
                f"{launcher} timed out after {args.timeout_s:.0f}s; log: {log_path}"
            ) from None
        except BaseException:
            _kill_session(proc)
            raise
        finally:
            # Ranks left behind by a crashed launcher lead their own sessions: sweep them too.
            _kill_stray_ranks(out_dir)
    if code != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RunFailed(f"{launcher} exited {code}; log {log_path}:\n{tail}")
    return time.monotonic() - start


def _kill_session(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the launcher's session, then SIGKILL it if it is still there after 10 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _kill_stray_ranks(out_dir: Path) -> None:
    for path in out_dir.glob("a*_r*.json"):
        with contextlib.suppress(ValueError, OSError):
            pid = int(json.loads(path.read_text())["pid"])
            if _is_our_worker(pid):
                os.killpg(pid, signal.SIGKILL)


def _is_our_worker(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return str(WORKER).encode() in cmdline


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def rank_phases(out_dir: Path, nproc: int, death: float) -> dict[str, float]:
    """Seconds from death to each rank milestone of attempt 1 (latest rank)."""
    marks = []
    for rank in range(nproc):
        path = out_dir / f"a1_r{rank}.json"
        if not path.exists():
            raise RunFailed(f"attempt 1 rank {rank} wrote no marks ({path})")
        marks.append(_read_json(path))
    return {key: max(float(m[key]) for m in marks) - death for key, _ in RANK_PHASES}


def ftd_phases(run_dir: Path, death_pid: int, death: float) -> dict[str, float]:
    """Seconds from death to ftd's own milestones, from its event log."""
    events: list[dict[str, Any]] = [
        json.loads(line)
        for line in (run_dir / "logs" / "bench" / "events.jsonl").read_text().splitlines()
        if line.strip()
    ]

    def first(kind: str, **match: Any) -> dict[str, Any]:
        for event in events:
            data = event.get("data", {})
            if event["kind"] == kind and all(data.get(k) == v for k, v in match.items()):
                return event
        raise RunFailed(f"no {kind} event matching {match} in ftd's event log")

    old_exits = [e for e in events if e["kind"] == "rank_exited" and e["data"].get("attempt") == 0]
    recovery = first("recovery", attempt=1)["data"]
    phases = {
        "detected": first("rank_exited", attempt=0, pid=death_pid)["time"] - death,
        "old_exited": max(e["time"] for e in old_exits) - death,
        "old_gone": first("workers_stopped", attempt=0)["time"] - death,
        "attempt_started": first("attempt_started", attempt=1)["time"] - death,
        "recovery_total": float(recovery["total_s"]),
    }
    phases.update({f"stage_{name}": float(s) for name, s in recovery["stages"].items()})
    return phases


TORCHRUN_LOG_TIME = re.compile(r"^[IWE](\d{4} \d\d:\d\d:\d\d\.\d{6}) \d+ ")


def torchrun_phases(run_dir: Path, death: float) -> dict[str, float]:
    """Seconds from death to torchrun's own milestones, from its (local time) log lines."""
    year = time.localtime(death).tm_year
    found: dict[str, float] = {}
    for line in (run_dir / "launcher.log").read_text(errors="replace").splitlines():
        match = TORCHRUN_LOG_TIME.match(line)
        if match is None:
            continue
        stamp = datetime.strptime(f"{year}{match[1]}", "%Y%m%d %H:%M:%S.%f").timestamp()
        if "closing signal" in line:
            found.setdefault("detected", stamp - death)
        elif "failed (exitcode" in line:
            found.setdefault("old_gone", stamp - death)
    missing = {"detected", "old_gone"} - found.keys()
    if missing:
        raise RunFailed(f"torchrun's log lacks the lines for {sorted(missing)}")
    return found


def watch_doomed_rank(out_dir: Path) -> None:
    """Write when the failing rank's process was gone (wall clock), as a pidfd tells it: the
    kernel's end of the process, a few ms after the rank's own last mark (`death.json`, before
    `os._exit`), and the earliest moment any launcher can know of it."""
    doomed = out_dir / "doomed.json"
    deadline = time.monotonic() + 600
    while not doomed.exists():
        if time.monotonic() > deadline:
            return
        time.sleep(0.005)
    try:
        gone = benchlib.wait_gone(int(_read_json(doomed)["pid"]), 600)
    except (OSError, ValueError, KeyError):
        return
    if gone is None:
        return
    (out_dir / "gone.json").write_text(json.dumps({"time": gone}))


def measure(launcher: str, args: argparse.Namespace, pair: int, position: int) -> RunResult:
    run_dir = Path(tempfile.mkdtemp(prefix=f"ftd_bench_{launcher}_"))
    keep = args.keep
    try:
        wall_s = run_launcher(launcher, args, run_dir)
        out_dir = run_dir / "out"
        death_path = out_dir / "death.json"
        if not death_path.exists():
            raise RunFailed(f"{launcher}: the failing rank wrote no {death_path}")
        death = _read_json(death_path)
        phases = rank_phases(out_dir, args.nproc, float(death["time"]))
        if launcher == "ftd":
            phases.update(ftd_phases(run_dir, int(death["pid"]), float(death["time"])))
            # The daemon's own account of the restart (its `recovery` stages, fault seen →
            # every rank resumed) against the ranks' (process gone → last first allreduce).
            gone_path = out_dir / "gone.json"
            if gone_path.exists():
                phases["process_gone"] = float(_read_json(gone_path)["time"]) - death["time"]
            resumed = [
                float(_read_json(out_dir / f"a1_r{rank}.json")["resumed"])
                for rank in range(args.nproc)
            ]
            measured = max(resumed) - death["time"] - phases.get("process_gone", 0.0)
            phases["stages_vs_measured"] = phases["recovery_total"] / measured - 1
        else:
            phases.update(torchrun_phases(run_dir, float(death["time"])))
        return RunResult(launcher, pair, position, wall_s, phases)
    except BaseException:
        keep = True
        print(f"run directory kept: {run_dir}", file=sys.stderr)
        raise
    finally:
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)


# -- reporting -----------------------------------------------------------------------------


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(results: list[RunResult]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for launcher in LAUNCHERS:
        runs = [r for r in results if r.launcher == launcher]
        if not runs:
            continue
        keys = [k for k, _ in LAUNCHER_PHASES + RANK_PHASES if all(k in r.phases for r in runs)]
        summary[launcher] = {k: _stats([r.phases[k] for r in runs]) for k in keys}
    pairs = sorted({r.pair for r in results})
    ratios = []
    for pair in pairs:
        by = {r.launcher: r for r in results if r.pair == pair}
        if len(by) == 2:
            ratios.append(by["ftd"].phases["allreduce"] / by["torchrun"].phases["allreduce"])
    ftd_runs = [r for r in results if r.launcher == "ftd" and "stages_vs_measured" in r.phases]
    if ftd_runs:
        gaps = [r.phases["stages_vs_measured"] for r in ftd_runs]
        summary["recovery_stages"] = {
            "stages": {
                name: _stats([r.phases[f"stage_{name}"] for r in ftd_runs])
                for name in ("detect", "stop", "rendezvous", "spawn", "init")
            },
            "total": _stats([r.phases["recovery_total"] for r in ftd_runs]),
            "largest_gap_to_measured": max(gaps, key=abs),
            "median_gap_to_measured": statistics.median(gaps),
            "process_gone": _stats([r.phases.get("process_gone", 0.0) for r in ftd_runs]),
        }
    if "ftd" in summary and "torchrun" in summary:
        summary["ratio_of_medians"] = (
            summary["ftd"]["allreduce"]["median"] / summary["torchrun"]["allreduce"]["median"]
        )
        summary["median_of_pair_ratios"] = statistics.median(ratios)
    return summary


def _cell(stats: dict[str, float] | None) -> str:
    if stats is None:
        return "-"
    return f"{stats['median'] * 1e3:7.0f} [{stats['min'] * 1e3:5.0f}-{stats['max'] * 1e3:5.0f}]"


def print_table(summary: dict[str, Any], n_pairs: int) -> None:
    ftd, torchrun = summary.get("ftd", {}), summary.get("torchrun", {})
    print(f"\nms after the failing rank's death: median [min-max] of {n_pairs} runs each\n")
    print(f"{'phase':46} {'ftd':>21}   {'torchrun':>21}")
    print("-" * 92)
    for key, label in LAUNCHER_PHASES + RANK_PHASES:
        if key not in ftd and key not in torchrun:
            continue
        print(f"{label:46} {_cell(ftd.get(key)):>21}   {_cell(torchrun.get(key)):>21}")
    print(FOOTNOTES)


def print_ratio(summary: dict[str, Any]) -> None:
    ftd, torchrun = summary.get("ftd", {}), summary.get("torchrun", {})
    if "attempt_started" in ftd:
        own = ftd["attempt_started"]["median"] * 1e3
        print(f"\nftd's own part (death -> attempt_started): median {own:.1f} ms (goal: <= 50 ms)")
    if "forked" in ftd and "forked" in torchrun:
        print(
            "launchers side by side (death -> last new rank forked): "
            f"ftd {ftd['forked']['median'] * 1e3:.0f} ms, "
            f"torchrun {torchrun['forked']['median'] * 1e3:.0f} ms"
        )
    if "ratio_of_medians" in summary:
        print(
            f"\ntotal ftd/torchrun: {summary['ratio_of_medians']:.3f} (ratio of medians), "
            f"{summary['median_of_pair_ratios']:.3f} (median of per-pair ratios)"
        )


def step_medians(results: list[RunResult]) -> dict[str, dict[str, float]]:
    """Per launcher: median over runs of each milestone minus the previous one."""
    steps: dict[str, dict[str, float]] = {}
    for launcher in LAUNCHERS:
        runs = [r for r in results if r.launcher == launcher]
        if not runs:
            continue
        out: dict[str, float] = {}
        for chain in (LAUNCHER_PHASES, RANK_PHASES):
            keys = [k for k, _ in chain if all(k in r.phases for r in runs)]
            previous: str | None = None
            for key in keys:
                out[key] = statistics.median(
                    r.phases[key] - (r.phases[previous] if previous else 0.0) for r in runs
                )
                previous = key
        steps[launcher] = out
    return steps


def print_steps(steps: dict[str, dict[str, float]]) -> None:
    ftd, torchrun = steps.get("ftd", {}), steps.get("torchrun", {})
    print("\nsteps, ms: median over runs of each milestone minus the previous one\n")
    for key, label in LAUNCHER_PHASES + RANK_PHASES:
        if key not in ftd and key not in torchrun:
            continue
        cells = [f"{s[key] * 1e3:7.1f}" if key in s else "      -" for s in (ftd, torchrun)]
        print(f"  {label:46} {cells[0]:>9}   {cells[1]:>9}")


def print_recovery(summary: dict[str, Any]) -> None:
    """ftd's recovery stages (its `recovery` events) and how they add up to what the ranks saw."""
    recovery = summary.get("recovery_stages")
    if not recovery:
        return
    print("\nftd's recovery stages (median [min-max] ms, from its `recovery` events):")
    for name, stats in recovery["stages"].items():
        print(f"  {name:<12} {_cell(stats)}")
    print(f"  {'total':<12} {_cell(recovery['total'])}")
    gone = _cell(recovery["process_gone"])
    print(f"  (before them: the rank's last mark -> its process gone, pidfd: {gone} ms)")
    gap, median = recovery["largest_gap_to_measured"], recovery["median_gap_to_measured"]
    print(
        "  stages' total against process gone -> last rank's resumed(): "
        f"median {median:+.1%}, largest {gap:+.1%}"
    )


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    torch_version = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "torch": torch_version,
        "kernel": platform.release(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "loadavg_at_start": os.getloadavg(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5, help="measured ftd/torchrun pairs")
    parser.add_argument("--warmup", type=int, default=1, help="unreported pairs run first")
    parser.add_argument("--nproc", type=int, default=4, help="ranks per job")
    parser.add_argument("--timeout-s", type=float, default=180.0, help="limit for one job")
    parser.add_argument("--ftd-args", default="", help="extra `ftd serve` flags (one string)")
    parser.add_argument("--torchrun-args", default="", help="extra torchrun flags (one string)")
    parser.add_argument(
        "--only", choices=LAUNCHERS, default=None, help="run one launcher only (no ratio)"
    )
    parser.add_argument("--python", default=sys.executable, help="interpreter for both")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    parser.add_argument("--keep", action="store_true", help="keep every run directory")
    args = parser.parse_args(argv)
    if args.nproc < 2:
        parser.error("--nproc must be at least 2 (rank 1 is the one that fails)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = machine()
    print(
        f"{info['nproc']} CPUs ({info['cpu_model']}), torch {info['torch']}, "
        f"load {info['loadavg_at_start'][0]:.2f}, {info['date_utc']}",
        flush=True,
    )
    launchers = (args.only,) if args.only else LAUNCHERS
    results: list[RunResult] = []
    for pair in range(-args.warmup, args.pairs):
        order = launchers if pair % 2 == 0 else launchers[::-1]
        for position, launcher in enumerate(order):
            try:
                result = measure(launcher, args, pair, position)
            except RunFailed as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            tag = "warm-up" if pair < 0 else f"pair {pair + 1}/{args.pairs}"
            print(
                f"{tag:12} {launcher:9} total {result.phases['allreduce'] * 1e3:6.0f} ms"
                + (
                    f"  (ftd's own part {result.phases['attempt_started'] * 1e3:5.1f} ms)"
                    if "attempt_started" in result.phases
                    else ""
                ),
                flush=True,
            )
            if pair >= 0:
                results.append(result)
    summary = summarize(results)
    steps = step_medians(results)
    print_table(summary, args.pairs)
    print_steps(steps)
    print_ratio(summary)
    print_recovery(summary)
    info["loadavg_at_end"] = os.getloadavg()
    print(f"load average at the end: {info['loadavg_at_end'][0]:.2f}")
    if args.json is not None:
        payload = {
            "command": [sys.executable, *sys.argv],
            "machine": info,
            "args": {k: str(v) for k, v in vars(args).items()},
            "runs": [asdict(r) for r in results],
            "summary": summary,
            "step_medians": steps,
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
