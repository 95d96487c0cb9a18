"""In-process restart against a full process restart, both under `ftd serve`, in one run.

A job of `--nproc` gloo ranks on CPU (bench/inprocess_worker.py) faults once: past the first
round's first allreduce, rank 1 faults while the others wait for it in an allreduce. Measured
from the fault to *training resumed*: every rank of the next round (in-process) or attempt
(process restart) has finished its first allreduce. Variants, the same worker in each:

  process     a RuntimeError in rank 1; `ftd serve` (restart mode process) stops every rank
              and starts them again: the plain torchrun script, no Wrapper; ranks are forked
              from the zygote (the default start method), torch already imported
  spawn       the same with `--start-method spawn`: fresh interpreters import torch again,
              as under torchrun
  inprocess   the same RuntimeError under ftd_client.inprocess.Wrapper and
              `--restart-mode inprocess`: every rank restarts the function in its process
  nvrx        the same, the script written for NVRx (`from nvidia_resiliency_ext import
              inprocess`, timedelta timeouts), unmodified: ftd's Wrapper all the same
  respawn     rank 1's process dies (os._exit); the daemon announces it, the others restart
              in-process and a new process for rank 1 joins them (world unchanged)
  shrink      the same death with --no-inprocess-respawn: the others go on at world N-1

    PYTHONPATH=.:client python bench/inprocess_restart.py --reps 5

The variants run in turn, the order rotating from one repetition to the next. Every timestamp
is wall-clock `time.time()` on this machine: the ranks' marks and ftd's event log share it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import benchlib

WORKER = Path(__file__).resolve().parent / "inprocess_worker.py"
VARIANTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # name: (ftd serve flags, worker flags)
    "process": ((), ("--inject", "raise")),
    "spawn": (("--start-method", "spawn"), ("--inject", "raise")),
    "inprocess": (("--restart-mode", "inprocess"), ("--wrap", "--inject", "raise")),
    # the same, the script written for NVRx (`from nvidia_resiliency_ext import inprocess`)
    "nvrx": (("--restart-mode", "inprocess"), ("--wrap", "--nvrx-import", "--inject", "raise")),
    "respawn": (("--restart-mode", "inprocess"), ("--wrap", "--inject", "exit")),
    "shrink": (
        ("--restart-mode", "inprocess", "--no-inprocess-respawn"),
        ("--wrap", "--inject", "exit"),
    ),
}
PROCESS_RESTARTS = ("process", "spawn")
PHASES = (
    ("detected", "fault -> seen by the daemon [1]"),
    ("restarted", "  -> new round decided / new ranks spawned [2]"),
    ("pg_up", "  -> last rank's process group up"),
    ("allreduce", "  -> last rank's first allreduce (TOTAL)"),
)
FOOTNOTES = """\
[1] process, spawn: rank_exited of the faulting pid; in-process: inprocess_fault (the leader
    daemon woken by the fault's announcement, which the faulting rank or, for a death, the
    daemon wrote)
[2] process, spawn: attempt_started of attempt 1; in-process: inprocess_round of round 1 (its
    members and process-group store published)"""


@dataclass
class Run:
    variant: str
    rep: int
    wall_s: float
    world: int
    phases: dict[str, float] = field(default_factory=dict)


class RunFailed(RuntimeError):
    pass


def measure(variant: str, rep: int, args: argparse.Namespace) -> Run:
    work = Path(tempfile.mkdtemp(prefix=f"ftd_inproc_{variant}_"))
    out = work / "out"
    out.mkdir()
    flags, worker_flags = VARIANTS[variant]
    proc = benchlib.serve(
        work,
        "bench",
        WORKER,
        ["--out", str(out), *worker_flags],
        "--nproc-per-node", str(args.nproc), "--max-restarts", "1", *flags,
    )  # fmt: skip
    keep = args.keep
    try:
        try:
            code = proc.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RunFailed(f"{variant}: timed out; output in {work}") from None
        if code != 0:
            raise RunFailed(f"{variant}: ftd serve exited {code}; output in {work}")
        return analyse(variant, rep, work, out)
    except BaseException:
        keep = True
        raise
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def analyse(variant: str, rep: int, work: Path, out: Path) -> Run:
    fault = json.loads((out / "fault.json").read_text())
    t = float(fault["time"])
    restarts_processes = variant in PROCESS_RESTARTS
    resumed = "a1_i0_s*.json" if restarts_processes else "a0_i1_s*.json"
    marks = [json.loads(p.read_text()) for p in sorted(out.glob(resumed))]
    if not marks:
        raise RunFailed(f"{variant}: no rank of the next round wrote its marks ({out})")
    events = benchlib.events(work / "bench")

    def first(kind: str, **match: Any) -> float:
        for event in events:
            data = event["data"]
            if event["kind"] == kind and all(data.get(k) == v for k, v in match.items()):
                return float(event["time"]) - t
        raise RunFailed(f"{variant}: no {kind} event matching {match} ({work})")

    if restarts_processes:
        detected = first("rank_exited", attempt=0, pid=fault["pid"])
        restarted = first("attempt_started", attempt=1)
    else:
        detected = first("inprocess_fault", round=0)
        restarted = first("inprocess_round", round=1)
    phases = {
        "detected": detected,
        "restarted": restarted,
        "pg_up": max(float(m["pg_up"]) for m in marks) - t,
        "allreduce": max(float(m["allreduce"]) for m in marks) - t,
    }
    wall = float(events[-1]["time"]) - float(events[0]["time"])
    return Run(variant, rep, wall, int(marks[0]["world"]), phases)


def cell(values: list[float]) -> str:
    stats = benchlib.summary(values)
    return f"{stats['median'] * 1e3:6.0f} [{stats['min'] * 1e3:5.0f}-{stats['max'] * 1e3:5.0f}]"


def report(runs: list[Run], variants: list[str]) -> dict[str, Any]:
    print("\nms after the fault: median [min-max] over the repetitions\n")
    print(f"{'phase':46}" + "".join(f"{v:>22}" for v in variants))
    print("-" * (46 + 22 * len(variants)))
    by = {v: [r for r in runs if r.variant == v] for v in variants}
    for key, label in PHASES:
        print(
            f"{label:46}" + "".join(f"{cell([r.phases[key] for r in by[v]]):>22}" for v in variants)
        )
    print(f"{'world after the fault':46}" + "".join(f"{by[v][0].world:>22}" for v in variants))
    print(FOOTNOTES)
    totals = {v: statistics.median(r.phases["allreduce"] for r in by[v]) for v in variants}
    summary: dict[str, Any] = {"median_total_s": totals}
    if any(b in totals for b in PROCESS_RESTARTS):
        print()
        for base in (b for b in PROCESS_RESTARTS if b in totals):
            for v in variants:
                if v in PROCESS_RESTARTS:
                    continue
                per_rep = [
                    a.phases["allreduce"] / b.phases["allreduce"]
                    for a in by[v]
                    for b in by[base]
                    if a.rep == b.rep
                ]
                ratio = totals[v] / totals[base]
                summary[f"{v}/{base}"] = {
                    "ratio_of_medians": ratio,
                    "median_of_rep_ratios": statistics.median(per_rep),
                }
                print(
                    f"{v}/{base}: {ratio:.3f} (ratio of medians), "
                    f"{statistics.median(per_rep):.3f} (median of per-repetition ratios)"
                )
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="measured runs of each variant")
    parser.add_argument("--warmup", type=int, default=1, help="unreported repetitions first")
    parser.add_argument("--nproc", type=int, default=4, help="ranks (at least 2)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="limit for one job")
    parser.add_argument("--json", type=Path, default=None, help="also write every run here")
    parser.add_argument("--keep", action="store_true", help="keep every run directory")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown or args.nproc < 2:
        parser.error(f"unknown variants {sorted(unknown)}" if unknown else "--nproc below 2")
    info = benchlib.machine()
    benchlib.print_machine(info)
    print(f"# command: {' '.join([sys.executable, *sys.argv])}")
    runs: list[Run] = []
    for rep in range(args.warmup + args.reps):
        shift = rep % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            run = measure(variant, rep, args)
            warm = " (warm-up)" if rep < args.warmup else ""
            print(
                f"rep {rep} {variant:9} total {run.phases['allreduce'] * 1e3:6.0f} ms, "
                f"world {run.world}{warm}",
                flush=True,
            )
            if rep >= args.warmup:
                runs.append(run)
    summary = report(runs, variants)
    if args.json is not None:
        payload = {"machine": info, "runs": [asdict(r) for r in runs], "summary": summary}
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
