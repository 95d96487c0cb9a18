"""Goodput under faults (issues 26, 41): one 2-rank DDP job (gloo, CPU, 107 MB of state per
rank, bench/goodput_worker.py), a rank SIGKILLed every --kill-every seconds for --duration
seconds, under each launcher with its way of keeping the state; --runs runs, each of every
variant one after the other (the order rotated from run to run):

  plain           torchrun, no checkpoint, no fault: the failure-free step time of the run
  ftd             ftd serve --preload torch._dynamo: checkpoint.save every step, a snapshot of
                  the node's memory each step (ftd's default, --checkpoint-every 1)
  ftd-auto        the same with --checkpoint-every auto (Young/Daly's interval, learned)
  torchrun        torchrun + dcp.save to a local disk directory every k steps
  torchrun-async  torchrun + dcp.async_save (a gloo group of its own) every k steps
  ft_launcher     NVRx's ft_launcher + LocalCheckpointManager on /dev/shm every k steps

Each baseline's k is Young/Daly's interval at a failure every --kill-every seconds, from what
one of its saves costs the job (the calibration phase before the runs): k = sqrt(2 C M) / step.

    PYTHONPATH=.:client .venv/bin/python bench/goodput.py          # 3 runs x 6 variants
    PYTHONPATH=.:client .venv/bin/python bench/goodput.py --runs 1 --duration 90 --kill-every 30

goodput = steps kept x t_ff / wall time (launch -> the job's last step), t_ff the median step
of the same run's plain variant: one estimator for every row. bench/GOODPUT.md.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import benchlib

BENCH_DIR = Path(__file__).resolve().parent
WORKER = BENCH_DIR / "goodput_worker.py"
VARIANTS = ("plain", "ftd", "ftd-auto", "torchrun", "torchrun-async", "ft_launcher")
KEEPERS = {"torchrun": "dcp", "torchrun-async": "dcp-async", "ft_launcher": "nvrx"}
NPROC = 2
PLAIN_WARMUP = 5  # the plain job's first steps: DDP's and the allocator's warm-up


def env() -> dict[str, str]:
    # torchrun's (and ft_launcher's) restarts need a store per attempt: pytorch/pytorch#135712
    return {
        **benchlib.child_env(),
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }


def ftd_cmd(
    work: Path, nproc: int, restarts: int, extra: list[str], script: list[str]
) -> list[str]:
    return [sys.executable, "-m", "ftd", "serve", "--api-port", "off", "--log-dir",
            str(work / "logs"), "--run-id", "goodput", "--nproc-per-node", str(nproc),
            "--max-restarts", str(restarts), *extra, str(WORKER), *script]  # fmt: skip


def command(variant: str, work: Path, out: Path, args: argparse.Namespace, deadline: float,
            restarts: int) -> list[str]:  # fmt: skip
    common = ["--out", str(out), "--deadline", f"{deadline:.3f}"]
    if variant.startswith("ftd"):
        extra = ["--preload", "torch._dynamo", *shlex.split(args.ftd_args)]
        if variant == "ftd-auto":
            extra += ["--checkpoint-every", "auto"]
        return ftd_cmd(work, NPROC, restarts, extra, ["--mode", "ftd", *common])
    bin_dir = Path(sys.executable).parent
    if variant == "plain":
        return [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", str(NPROC),
                str(WORKER), "--mode", "plain", *common]  # fmt: skip
    every = str(args.every[variant])
    if variant.startswith("torchrun"):
        script = ["--mode", KEEPERS[variant], "--ckpt-dir", str(work / "dcp"), "--every", every]
        return [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", str(NPROC),
                "--max-restarts", str(restarts), str(WORKER), *script, *common]  # fmt: skip
    script = ["--mode", "nvrx", "--ckpt-dir", str(nvrx_dir()), "--every", every]
    return [str(bin_dir / "ft_launcher"), "--standalone", "--nproc-per-node", str(NPROC),
            "--max-restarts", str(restarts), "--ft-param-initial_rank_heartbeat_timeout=300",
            "--ft-param-rank_heartbeat_timeout=120", str(WORKER), *script, *common]  # fmt: skip


def nvrx_dir() -> Path:
    return Path("/dev/shm") / f"ftd-goodput-{os.getpid()}"


# -- processes ---------------------------------------------------------------------------------


def start(cmd: list[str], work: Path, name: str) -> subprocess.Popen[bytes]:
    log = (work / f"{name}.log").open("wb")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env(), cwd=work, start_new_session=True)  # fmt: skip


def stop(proc: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """The launcher's exit code, or None when it had to be killed after `timeout_s`."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        return None


def parents() -> dict[int, int]:
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                found[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    return found


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, ppid in parents().items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def start_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def live_rank(out: Path, launcher: int, rank: int) -> tuple[int, int] | None:
    """(pid, attempt) of `rank`'s newest process if it is alive and the launcher's: its pid file
    (written by the rank) names it, the start time rules out a reused pid, and it must descend
    from the launcher. (Ranks forked by ftd's zygote carry the zygote's cmdline, so the cmdline
    alone cannot tell them; torchrun's and ft_launcher's do have the script in it.)"""
    family = descendants(launcher)
    best: tuple[int, int] | None = None
    for path in out.glob(f"pid-*-{rank}.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            info = json.loads(path.read_text())
            pid, attempt = int(info["pid"]), int(info["attempt"])
            ours = pid in family and start_ticks(pid) == int(info["start_ticks"])
            if ours and (best is None or attempt > best[1]):
                best = (pid, attempt)
    return best


class LoadSampler:
    """The 1-minute load average every 5 s while a variant runs: the VM is shared."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(5.0):
            with contextlib.suppress(OSError, ValueError):
                self.samples.append(float(Path("/proc/loadavg").read_text().split()[0]))

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def run_with_kills(variant: str, args: argparse.Namespace, root: Path, run: int) -> dict[str, Any]:
    work = benchlib.fresh_dir(root / f"run{run}" / variant)
    out = work / "out"
    duration = args.plain_duration if variant == "plain" else args.duration
    kills_planned = 0 if variant == "plain" else int((duration - 1e-9) // args.kill_every)
    restarts = kills_planned + 3
    t_launch = time.time()
    deadline = t_launch + duration
    cmd = command(variant, work, out, args, deadline, restarts)
    print(f"## run {run}, {variant}: {shlex.join(cmd)}", flush=True)
    proc = start(cmd, work, "launcher")
    load = LoadSampler()
    kills: list[dict[str, Any]] = []
    try:
        for k in range(1, kills_planned + 1):
            target = t_launch + k * args.kill_every
            while time.time() < target and proc.poll() is None:
                time.sleep(min(0.05, max(target - time.time(), 0.001)))
            rank = (k - 1) % NPROC
            found = None
            while proc.poll() is None and time.time() < deadline:
                found = live_rank(out, proc.pid, rank)
                if found is not None:
                    break
                time.sleep(0.02)
            if found is None:
                break
            t_kill = time.time()
            with contextlib.suppress(ProcessLookupError):
                os.kill(found[0], signal.SIGKILL)
            kills.append({"k": k, "rank": rank, "pid": found[0], "attempt": found[1],
                          "t": t_kill, "late_s": t_kill - target})  # fmt: skip
            print(f"  kill {k}: rank {rank} (pid {found[0]}, attempt {found[1]}) at "
                  f"{t_kill - t_launch:.1f} s", flush=True)  # fmt: skip
        code = stop(proc, duration + args.grace_s - (time.time() - t_launch))
    finally:
        load.stop()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if variant == "ft_launcher":
            shutil.rmtree(nvrx_dir(), ignore_errors=True)
    result = analyse(out, kills, t_launch)
    result |= {
        "loadavg_1m": benchlib.summary(load.samples) if load.samples else None,
        "variant": variant,
        "run": run,
        "t_launch": t_launch,
        "out": str(out),
        "command": shlex.join(cmd),
        "exit": code,
        "kills": kills,
    }
    if code != 0:
        tail = (work / "launcher.log").read_text(errors="replace")[-2000:]
        print(f"  !! {variant} exited {code}; log {work / 'launcher.log'}:\n{tail}", flush=True)
    return result


# -- reading the ranks' logs ---------------------------------------------------------------------


def records(out: Path) -> list[list[dict[str, Any]]]:
    logs = []
    for rank in range(NPROC):
        path = out / f"log-{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        logs.append([json.loads(line) for line in lines if line.endswith("}")])
    return logs


def analyse(out: Path, kills: list[dict[str, Any]], t_launch: float) -> dict[str, Any]:
    logs = records(out)
    steps = [[r for r in log if r["kind"] == "step"] for log in logs]
    starts = [{r["a"]: r for r in log if r["kind"] == "start"} for log in logs]
    done = steps[0]
    if not done:
        return {"error": "no step done"}
    last = done[-1]
    wall = last["t"] - t_launch
    kept = int(last["s"])
    result: dict[str, Any] = {
        "wall_s": wall,
        "steps_kept": kept,
        "steps_done": len(done),
        "steps_lost": len(done) - kept,
        "finished": any(r["kind"] == "end" for r in logs[0]),
    }
    paces = [b["t"] - a["t"] for a, b in itertools.pairwise(done) if a["a"] == b["a"]]
    if paces:
        result["run_step_s"] = statistics.median(paces)
        result["paces_s"] = paces
    saves = [r["save_s"] for r in done if r.get("save_s") is not None]
    if saves:
        result["save_call_s"] = benchlib.summary(saves) | {"mean": statistics.fmean(saves)}
    stats = [r for log in logs for r in log if r["kind"] == "stats"]
    if stats:
        result["last_attempt_stats"] = stats
    failures = []
    for kill in kills:
        a = kill["attempt"]
        nxt = [s.get(a + 1) for s in starts]
        reached = [r["s"] for log in steps for r in log if r["a"] == a]
        resumed_a = starts[0].get(a, {}).get("resumed", 0)
        s_kill = max(reached, default=resumed_a)
        failure: dict[str, Any] = {"k": kill["k"], "rank": kill["rank"], "attempt": a,
                                   "step_at_kill": s_kill}  # fmt: skip
        if any(n is None for n in nxt):
            failures.append(failure | {"incomplete": "no next attempt on every rank"})
            continue
        t_script = max(n["t0"] for n in nxt)
        t_ready = max(n["t_pg"] for n in nxt)
        t_restored = max(n["t_restored"] for n in nxt)
        resumed = int(nxt[0]["resumed"])
        lost = s_kill - resumed
        again = [r["t"] for r in done if r["a"] == a + 1 and r["s"] == s_kill]
        back = t_restored if lost <= 0 else (again[0] if again else None)
        failure |= {
            "resumed": resumed,
            "steps_lost": lost,
            "launcher_s": t_script - kill["t"],
            "init_s": t_ready - t_script,
            "pg_s": max(n["t_dist"] for n in nxt) - t_script if "t_dist" in nxt[0] else None,
            "restore_s": t_restored - t_ready,
            "restore_inner_s": [n.get("restore_s") for n in nxt],
            "redo_s": None if back is None else back - t_restored,
            "total_s": None if back is None else back - kill["t"],
        }
        failures.append(failure)
    result["failures"] = failures
    lost = [f["total_s"] for f in failures if f.get("total_s") is not None]
    result["failures_lost_s"] = sum(lost)
    result["failures_lost_share"] = sum(lost) / wall
    # where the wall time went, independent of t_ff (the VM's load moves t_ff by up to 2x)
    first = [s.get(0) for s in starts]
    if all(first):
        result["startup_s"] = max(f["t_restored"] for f in first if f) - t_launch
    result["saves_s"] = sum(saves)
    result["stepping_s"] = wall - result.get("startup_s", 0.0) - sum(lost) - sum(saves)
    for key in ("launcher_s", "init_s", "restore_s", "redo_s", "total_s", "steps_lost"):
        values = [f[key] for f in failures if f.get(key) is not None]
        if values:
            result[f"per_failure_{key}"] = benchlib.summary([float(v) for v in values])
    return result


# -- the ftd-only phases -------------------------------------------------------------------------


def cost_phase(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    work = benchlib.fresh_dir(root / "cost")
    script = ["--mode", "cost", "--out", str(work / "out"), "--blocks", str(args.cost_blocks),
              "--block", str(args.cost_block)]  # fmt: skip
    cmd = ftd_cmd(work, NPROC, 0, shlex.split(args.ftd_args), script)
    print(f"## cost: {shlex.join(cmd)}", flush=True)
    code = stop(start(cmd, work, "launcher"), args.grace_s + 60 * args.cost_blocks)
    logs = records(work / "out")
    plain, saving = [], []
    for r0 in (r for r in logs[0] if r["kind"] == "cost"):
        if r0["i"] >= 2:  # the block's first steps: warm-up, or the last copy's tail
            (saving if r0["save"] else plain).append(float(r0["dt"]))
    if not plain or not saving:
        raise SystemExit(f"cost phase failed (exit {code}); see {work}")
    t_ff = statistics.median(plain)
    return {
        "command": shlex.join(cmd),
        "exit": code,
        "t_ff_s": t_ff,
        "plain_samples": plain,
        "plain_step_s": benchlib.summary(plain) | {"mean": statistics.fmean(plain)},
        "save_step_s": benchlib.summary(saving) | {"mean": statistics.fmean(saving)},
        "save_cost_median": statistics.median(saving) / t_ff - 1,
        "save_cost_mean": statistics.fmean(saving) / statistics.fmean(plain) - 1,
        "stats": [r for log in logs for r in log if r["kind"] == "stats"],
    }


def calibrate_phase(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Each baseline keeper's cost per save (C) and the plain step, from alternating blocks
    under torchrun, without faults; its Young/Daly interval at a failure every --kill-every."""
    found: dict[str, Any] = {}
    bin_dir = Path(sys.executable).parent
    for variant, keeper in KEEPERS.items():
        if variant not in args.variants:
            continue
        if variant in args.interval:  # given: a run to add to an earlier invocation's
            found[variant] = {"keeper": keeper, "every": args.interval[variant], "given": True}
            continue
        work = benchlib.fresh_dir(root / f"calibrate-{keeper}")
        ckpt = nvrx_dir() if keeper == "nvrx" else work / "ckpt"
        script = [
            "--mode",
            "calibrate",
            "--keeper",
            keeper,
            "--out",
            str(work / "out"),
            "--ckpt-dir",
            str(ckpt),
            "--every",
            str(args.calibrate_every),
            "--blocks",
            str(args.calibrate_blocks),
            "--block",
            str(args.calibrate_block),
        ]
        cmd = [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", str(NPROC),
               str(WORKER), *script]  # fmt: skip
        print(f"## calibrate {keeper}: {shlex.join(cmd)}", flush=True)
        code = stop(start(cmd, work, "launcher"), args.grace_s + 30 * args.calibrate_blocks)
        shutil.rmtree(nvrx_dir(), ignore_errors=True)
        blocks = [r for r in records(work / "out")[0] if r["kind"] == "block"][2:]  # warm-up
        plain = [b["dt"] / b["steps"] for b in blocks if not b["saving"]]
        saving = [b for b in blocks if b["saving"]]
        if code != 0 or not plain or not saving:
            raise SystemExit(f"calibration of {keeper} failed (exit {code}); see {work}")
        step_s = statistics.median(plain)
        per_save = [(b["dt"] - step_s * b["steps"]) / b["saves"] for b in saving]
        calls = [c for b in saving for c in b["calls"]]
        # at least what the training waits for (the call): the blocks' difference is noisy
        cost_s = max(statistics.median(per_save), statistics.median(calls))
        every = max(1, round(math.sqrt(2 * cost_s * args.kill_every) / step_s))
        found[variant] = {
            "keeper": keeper,
            "command": shlex.join(cmd),
            "step_s": step_s,
            "save_cost_s": cost_s,
            "per_save_s": per_save,
            "call_s": calls,
            "every": every,
        }
        print(f"   {keeper}: a save costs {cost_s:.3f} s, step {step_s * 1000:.0f} ms: "
              f"every {every} steps", flush=True)  # fmt: skip
    return found


# -- report ----------------------------------------------------------------------------------------


def fmt(summary: dict[str, float] | None, scale: float = 1.0, unit: str = "s") -> str:
    if not summary:
        return "-"
    return f"{summary['median'] * scale:.2f} / {summary['max'] * scale:.2f} {unit}"


def t_ff_of(runs: list[dict[str, Any]], run: int) -> float | None:
    """The estimator's failure-free step: the median step of run `run`'s plain job."""
    plain = [r for r in runs if r["variant"] == "plain" and r["run"] == run]
    paces = plain[0].get("paces_s", [])[PLAIN_WARMUP:] if plain else []
    return statistics.median(paces) if paces else None


def score(results: dict[str, Any]) -> None:
    """Each run's goodput by the one estimator (t_ff of its own plain job)."""
    for run in results["variants"]:
        t_ff = t_ff_of(results["variants"], run["run"])
        if t_ff is not None and "wall_s" in run:
            run["t_ff_s"] = t_ff
            run["goodput"] = run["steps_kept"] * t_ff / run["wall_s"]


def aggregate(results: dict[str, Any], variant: str) -> dict[str, Any]:
    runs = [r for r in results["variants"] if r["variant"] == variant and "goodput" in r]
    failures = [f for r in runs for f in r["failures"] if f.get("total_s") is not None]
    lost = [float(f["steps_lost"]) for f in failures]
    return {
        "runs": len(runs),
        "goodput": [r["goodput"] for r in runs],
        "kills": sum(len(r["kills"]) for r in runs),
        "failures_measured": len(failures),
        "total_s": benchlib.summary([f["total_s"] for f in failures]) if failures else None,
        "launch_s": benchlib.summary([f["launcher_s"] + f["init_s"] for f in failures])
        if failures
        else None,
        "restore_s": benchlib.summary([f["restore_s"] for f in failures]) if failures else None,
        "redo_s": benchlib.summary([f["redo_s"] for f in failures]) if failures else None,
        "steps_lost": benchlib.summary(lost) | {"mean": statistics.fmean(lost)} if lost else None,
        "at_most_one_lost": sum(v <= 1 for v in lost) / len(lost) if lost else None,
        "steps_kept": [r["steps_kept"] for r in runs],
        "exits": [r["exit"] for r in runs],
        # what keeping the state costs a step: its mean step (within attempts) over t_ff
        "step_overhead": [statistics.fmean(r["paces_s"]) / r["t_ff_s"] - 1 for r in runs],
    }


def model(results: dict[str, Any], variant: str, mtbf_s: float) -> dict[str, float] | None:
    """The share of the wall time a failure every `mtbf_s` costs `variant` (Young/Daly's first
    order model, from what this invocation measured): C, a checkpoint's cost; tau, the time
    between checkpoints (every step for ftd, its interval for ftd-auto, at the baselines' best,
    sqrt(2 C M), for them); R, a restart's launch, init and restore; per failure the redo of
    tau / 2 and the step in flight. waste = C / tau + (R + tau / 2 + t / 2) / M."""
    runs = [r for r in results["variants"] if r["variant"] == variant and "t_ff_s" in r]
    agg = aggregate(results, variant)
    if not runs or agg["failures_measured"] == 0:
        return None
    step = statistics.median(r["t_ff_s"] for r in runs)
    failures = [f for r in runs for f in r["failures"] if f.get("restore_s") is not None]
    restart = statistics.median(f["launcher_s"] + f["init_s"] + f["restore_s"] for f in failures)
    if variant.startswith("ftd"):
        cost = results["cost"]["save_cost_median"] * results["cost"]["t_ff_s"]
        tau = step if variant == "ftd" else max(step, math.sqrt(2 * cost * mtbf_s))
    elif "save_cost_s" not in results["calibration"][variant]:
        return None
    else:
        cost = results["calibration"][variant]["save_cost_s"]
        tau = max(step, math.sqrt(2 * cost * mtbf_s))
    waste = cost / tau + (restart + tau / 2 + step / 2) / mtbf_s
    return {"C_s": cost, "tau_s": tau, "R_s": restart, "t_s": step, "waste": waste}


def report(results: dict[str, Any]) -> None:
    cost = results.get("cost") or {}
    if cost:
        print(f"\nftd, a snapshot every step (cost phase): median {cost['save_cost_median']:+.1%}, "
              f"mean {cost['save_cost_mean']:+.1%} per step")  # fmt: skip
    for variant, cal in (results.get("calibration") or {}).items():
        if cal.get("given"):
            print(f"{variant}: every {cal['every']} steps (given)")
            continue
        print(f"{variant}: a save costs {cal['save_cost_s']:.3f} s (step "
              f"{cal['step_s'] * 1000:.0f} ms): Young/Daly every {cal['every']} steps")  # fmt: skip
    print("\n| variant | goodput (median; min-max of runs) | kills | per failure: total "
          "(median / max) | launch+init | restore | redo | steps lost per failure (median / "
          "mean / max) | failures with <= 1 lost | cost per step |")  # fmt: skip
    for variant in results["args"]["variants"]:
        agg = aggregate(results, variant)
        results.setdefault("summary", {})[variant] = agg
        if not agg["goodput"]:
            continue
        good = agg["goodput"]
        lost = agg["steps_lost"]
        lost_s = (
            "-"
            if lost is None
            else (f"{lost['median']:.0f} / {lost['mean']:.1f} / {lost['max']:.0f}")
        )
        share = "-" if agg["at_most_one_lost"] is None else f"{agg['at_most_one_lost']:.0%}"
        print(f"| {variant} | {statistics.median(good):.3f} ({min(good):.3f}-{max(good):.3f}) | "
              f"{agg['kills']} | {fmt(agg['total_s'])} | {fmt(agg['launch_s'])} | "
              f"{fmt(agg['restore_s'])} | {fmt(agg['redo_s'])} | {lost_s} | {share} | "
              f"{statistics.median(agg['step_overhead']):+.1%} |")  # fmt: skip
    mtbfs = (results["args"]["kill_every"], 600.0, 3600.0, 3 * 3600.0)
    heads = " | ".join(f"waste at M = {m:.0f} s" for m in mtbfs)
    print(f"\n| variant | C | R | t | {heads} |")
    for variant in results["args"]["variants"]:
        figures = [model(results, variant, m) for m in mtbfs]
        if variant == "plain" or figures[0] is None:
            continue
        first = figures[0]
        results.setdefault("model", {})[variant] = dict(zip(map(str, mtbfs), figures, strict=True))
        print(f"| {variant} | {first['C_s']:.3f} s | {first['R_s']:.2f} s | "
              f"{first['t_s'] * 1000:.0f} ms | "
              + " | ".join(f"{f['waste']:.1%} (tau {f['tau_s']:.1f} s)" for f in figures if f)
              + " |")  # fmt: skip


def reanalyse(path: Path) -> None:
    results = json.loads(path.read_text())
    for i, run in enumerate(results["variants"]):
        fresh = analyse(Path(run["out"]), run["kills"], run["t_launch"])
        results["variants"][i] = run | fresh
    score(results)
    report(results)
    benchlib.write_atomic(path, json.dumps(results, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--duration", type=float, default=225.0, help="seconds per variant")
    parser.add_argument("--kill-every", type=float, default=30.0)
    parser.add_argument("--plain-duration", type=float, default=90.0)
    parser.add_argument("--variants", nargs="*", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--ftd-args", default="", help="extra flags of the ftd variants")
    parser.add_argument(
        "--interval",
        nargs="*",
        default=[],
        metavar="VARIANT=STEPS",
        help="a baseline's interval, not calibrated (to add runs to an earlier invocation's)",
    )
    parser.add_argument("--calibrate-every", type=int, default=5)
    parser.add_argument("--calibrate-blocks", type=int, default=8)
    parser.add_argument("--calibrate-block", type=int, default=20)
    parser.add_argument("--cost-blocks", type=int, default=8)
    parser.add_argument("--cost-block", type=int, default=20)
    parser.add_argument(
        "--grace-s", type=float, default=240.0, help="a job's end after its deadline"
    )
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/ftd-bench/goodput"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--reanalyse", type=Path, default=None,
                        help="read the ranks' logs of this results file's runs again")  # fmt: skip
    args = parser.parse_args()
    if args.reanalyse:
        reanalyse(args.reanalyse)
        return
    if "plain" not in args.variants:
        raise SystemExit("the plain variant is the estimator's failure-free step: keep it")
    info = benchlib.machine()
    benchlib.print_machine(info)
    print(f"# command: {shlex.join([sys.executable, *sys.argv])}", flush=True)
    args.interval = {k: int(v) for k, _, v in (item.partition("=") for item in args.interval)}
    root = benchlib.fresh_dir(args.work_dir)
    results: dict[str, Any] = {"machine": info, "argv": sys.argv, "variants": []}
    results["calibration"] = calibrate_phase(args, root)
    args.every = {v: cal["every"] for v, cal in results["calibration"].items()}
    if "ftd" in args.variants or "ftd-auto" in args.variants:
        results["cost"] = cost_phase(args, root)
    results["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    stamp = time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
    out = args.json or BENCH_DIR / "results" / f"goodput_{stamp}.json"
    for run in range(1, args.runs + 1):
        shift = (run - 1) % len(args.variants)
        for variant in args.variants[shift:] + args.variants[:shift]:
            results["variants"].append(run_with_kills(variant, args, root, run))
            score(results)
            benchlib.write_atomic(out, json.dumps(results, indent=2))
        report(results)
    benchlib.write_atomic(out, json.dumps(results, indent=2))
    print(f"\nresults: {out}")


if __name__ == "__main__":
    main()
