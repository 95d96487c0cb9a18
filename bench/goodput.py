"""Goodput under faults (issue 26): one 2-rank DDP job (gloo, CPU, 107 MB of state per rank,
bench/goodput_worker.py), a rank SIGKILLed every --kill-every seconds for --duration seconds,
under each launcher with its way of keeping the state, one after the other in one invocation:

  ftd          ftd serve --max-restarts N, ftd_client.checkpoint.save every step (node memory)
  torchrun     torchrun + torch.distributed.checkpoint to a local disk directory every 50 steps
  ft_launcher  NVRx's ft_launcher + LocalCheckpointManager on /dev/shm every --nvrx-every steps
  ftd-backoff  (not in the default list) ftd with its default --restart-backoff

Before them, two short ftd phases: "cost" (the failure-free step time without checkpointing,
and the per-step cost of save, alternating blocks in one job) and "restore" (checkpoint.load of
a --restore-mb MiB state after a rank's death, --restore-rounds times).

    PYTHONPATH=.:client .venv/bin/python bench/goodput.py                       # 3 x 600 s
    PYTHONPATH=.:client .venv/bin/python bench/goodput.py --duration 90 --kill-every 30

goodput = steps kept x failure-free step time / wall time (launch -> the job's last step).
Definitions and the per-failure split: bench/GOODPUT.md.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
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
VARIANTS = ("ftd", "torchrun", "ft_launcher", "ftd-backoff", "ftd-preload")
DEFAULT_VARIANTS = ("ftd", "torchrun", "ft_launcher")
NPROC = 2


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
        extra = shlex.split(args.ftd_args) if variant != "ftd-backoff" else []
        extra += ["--checkpoint-every", args.ftd_every]
        if variant == "ftd-preload":  # what DDP imports, in the zygote before the first ranks
            extra += ["--preload", "torch._dynamo"]
        return ftd_cmd(work, NPROC, restarts, extra, ["--mode", "ftd", *common])
    bin_dir = Path(sys.executable).parent
    if variant == "torchrun":
        script = ["--mode", "dcp", "--ckpt-dir", str(work / "dcp"), "--every", str(args.dcp_every)]
        return [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", str(NPROC),
                "--max-restarts", str(restarts), str(WORKER), *script, *common]  # fmt: skip
    shm = Path("/dev/shm") / f"ftd-goodput-{os.getpid()}"
    script = ["--mode", "nvrx", "--ckpt-dir", str(shm), "--every", str(args.nvrx_every)]
    return [str(bin_dir / "ft_launcher"), "--standalone", "--nproc-per-node", str(NPROC),
            "--max-restarts", str(restarts), "--ft-param-initial_rank_heartbeat_timeout=300",
            "--ft-param-rank_heartbeat_timeout=120", str(WORKER), *script, *common]  # fmt: skip


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


def baseline(args: argparse.Namespace, root: Path, name: str) -> list[float]:
    """Rank 0's step times of plain training (no checkpoint, no fault), `--baseline-steps`."""
    work = benchlib.fresh_dir(root / name)
    script = ["--mode", "plain", "--out", str(work / "out"), "--steps", str(args.baseline_steps)]
    cmd = ftd_cmd(work, NPROC, 0, [], script)
    code = stop(start(cmd, work, "launcher"), args.grace_s + 5 * args.baseline_steps)
    done = [r for r in records(work / "out")[0] if r["kind"] == "step"]
    times = [b["t"] - a["t"] for a, b in itertools.pairwise(done[1:])]  # step 1 warms up
    if code != 0 or not times:
        raise SystemExit(f"baseline {name} failed (exit {code}); see {work}")
    return times


def run_with_kills(variant: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    plain = baseline(args, root, f"{variant}-baseline")
    work = benchlib.fresh_dir(root / variant)
    out = work / "out"
    kills_planned = int((args.duration - 1e-9) // args.kill_every)
    restarts = kills_planned + 3
    t_launch = time.time()
    deadline = t_launch + args.duration
    cmd = command(variant, work, out, args, deadline, restarts)
    print(f"## {variant}: {shlex.join(cmd)}", flush=True)
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
        code = stop(proc, args.duration + args.grace_s - (time.time() - t_launch))
    finally:
        load.stop()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if variant == "ft_launcher":
            shutil.rmtree(Path("/dev/shm") / f"ftd-goodput-{os.getpid()}", ignore_errors=True)
    result = analyse(out, kills, t_launch, args.t_ff)
    if "save_call_s" in result:
        # Young/Daly: the interval that minimises (save time + expected redo) per failure
        best_s = (2 * result["save_call_s"]["median"] * args.kill_every) ** 0.5
        result["young_daly_every_steps"] = best_s / statistics.median(plain)
    if "wall_s" in result:
        result["t_ff_adjacent_s"] = statistics.median(plain)
        result["goodput_adjacent"] = (
            result["steps_kept"] * statistics.median(plain) / result["wall_s"]
        )
    result |= {
        "loadavg_1m": benchlib.summary(load.samples) if load.samples else None,
        "baseline_step_s": plain,
        "variant": variant,
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


def checkpointed(step: dict[str, Any]) -> bool:
    """Whether a checkpoint was taken in this step (a copy then overlaps the next one); logs
    without `ck` (run 4): a save call of more than 0.8 ms (ftd's that take no snapshot: 0.25)."""
    if "ck" in step:
        return bool(step["ck"])
    return step.get("save_s") is not None and step["save_s"] > 0.0008


def analyse(out: Path, kills: list[dict[str, Any]], t_launch: float, t_ff: float) -> dict[str, Any]:
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
        "goodput": kept * t_ff / wall,
        "finished": any(r["kind"] == "end" for r in logs[0]),
    }
    paces = [b["t"] - a["t"] for a, b in itertools.pairwise(done) if a["a"] == b["a"]]
    if paces:
        result["run_step_s"] = statistics.median(paces)
    # the failure-free step of the same minutes: steps of the run with no checkpoint in them
    clean = [b["t"] - a["t"] for a, b in itertools.pairwise(done)
             if a["a"] == b["a"] and not checkpointed(a) and not checkpointed(b)]  # fmt: skip
    if clean:
        t_ff_run = statistics.fmean(clean)
        result["t_ff_run_s"] = benchlib.summary(clean) | {"mean": t_ff_run}
        result["goodput_run"] = kept * t_ff_run / wall
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


def restore_phase(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    work = benchlib.fresh_dir(root / "restore")
    script = ["--mode", "restore", "--out", str(work / "out"), "--mb", str(args.restore_mb),
              "--rounds", str(args.restore_rounds)]  # fmt: skip
    cmd = ftd_cmd(work, 1, args.restore_rounds, shlex.split(args.ftd_args), script)
    print(f"## restore: {shlex.join(cmd)}", flush=True)
    code = stop(start(cmd, work, "launcher"), args.grace_s + 30 * args.restore_rounds)
    path = work / "out" / "log-0.jsonl"
    found = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    found = [r for r in found if r["kind"] == "restore"]
    if not found:
        return {"command": shlex.join(cmd), "exit": code, "error": f"no restore; see {work}"}
    return {
        "command": shlex.join(cmd),
        "exit": code,
        "samples": found,
        "restore_s": benchlib.summary([r["restore_s"] for r in found]),
        "around_load_s": benchlib.summary([r["around_s"] for r in found]),
        "all_ok": all(r["ok"] for r in found),
    }


# -- report ----------------------------------------------------------------------------------------


def fmt(summary: dict[str, float] | None, scale: float = 1.0, unit: str = "s") -> str:
    if not summary:
        return "-"
    return f"{summary['median'] * scale:.2f} / {summary['max'] * scale:.2f} {unit}"


def report(results: dict[str, Any]) -> None:
    cost = results["cost"]
    print(f"\nfailure-free step (pooled) {results['t_ff_pooled_s'] * 1000:.0f} ms; cost phase "
          f"{cost['t_ff_s'] * 1000:.0f} ms; with save every step: median "
          f"{cost['save_cost_median']:+.1%}, mean {cost['save_cost_mean']:+.1%}")  # fmt: skip
    restore = results.get("restore") or {}
    if "restore_s" in restore:
        print(f"restore of {results['args']['restore_mb']} MiB: load's restore_s median / max "
              f"{fmt(restore['restore_s'], 1000, 'ms')}, around load "
              f"{fmt(restore['around_load_s'], 1000, 'ms')}, "
              f"bit-checked {restore['all_ok']}")  # fmt: skip
    print("\n| variant | goodput | adjacent | wall s | kept | lost | kills | launcher+init |"
          " restore | redo | per failure (median / max) | load |")  # fmt: skip
    for run in results["variants"]:
        if "goodput" not in run:
            print(f"| {run['variant']} | failed: {run.get('error')} |")
            continue
        launch = [f["launcher_s"] + f["init_s"] for f in run["failures"] if "init_s" in f]
        print(f"| {run['variant']} | {run['goodput']:.3f} | {run['goodput_adjacent']:.3f} | "
              f"{run['wall_s']:.0f} | "
              f"{run['steps_kept']} | {run['steps_lost']} | {len(run['kills'])} | "
              f"{fmt(benchlib.summary(launch) if launch else None)} | "
              f"{fmt(run.get('per_failure_restore_s'))} | {fmt(run.get('per_failure_redo_s'))} | "
              f"{fmt(run.get('per_failure_total_s'))} | "
              f"{fmt(run.get('loadavg_1m'), unit='')} |")  # fmt: skip
    for run in results["variants"]:
        if "run_step_s" in run:
            print(f"{run['variant']}: step in the run {run['run_step_s'] * 1000:.0f} ms (median), "
                  f"failures cost {run['failures_lost_s']:.1f} s = "
                  f"{run['failures_lost_share']:.1%} of the wall time")  # fmt: skip
        if "goodput_run" in run:
            clean = run["t_ff_run_s"]
            print(f"{run['variant']}: goodput {run['goodput_run']:.3f} with the run's own "
                  f"failure-free step ({clean['mean'] * 1000:.1f} ms mean, "
                  f"{clean['median'] * 1000:.1f} median, of {clean['n']:.0f} steps with no "
                  "checkpoint in them)")  # fmt: skip


def reanalyse(path: Path) -> None:
    results = json.loads(path.read_text())
    for i, run in enumerate(results["variants"]):
        cmd = shlex.split(run["command"])
        out = Path(run.get("out") or cmd[cmd.index("--out") + 1])
        t_launch = run.get("t_launch")
        if t_launch is None:
            t_launch = float(cmd[cmd.index("--deadline") + 1]) - results["args"]["duration"]
        fresh = analyse(out, run["kills"], t_launch, results["t_ff_pooled_s"])
        if "t_ff_adjacent_s" in run:
            fresh["goodput_adjacent"] = (
                fresh["steps_kept"] * run["t_ff_adjacent_s"] / fresh["wall_s"]
            )
        results["variants"][i] = run | fresh | {"t_launch": t_launch, "out": str(out)}
    benchlib.write_atomic(path, json.dumps(results, indent=2))
    report(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds per variant")
    parser.add_argument("--kill-every", type=float, default=60.0)
    parser.add_argument("--variants", nargs="*", choices=VARIANTS, default=list(DEFAULT_VARIANTS))
    parser.add_argument("--dcp-every", type=int, default=50)
    parser.add_argument("--nvrx-every", type=int, default=15, help="see GOODPUT.md: why 15")
    parser.add_argument("--ftd-args", default="--restart-backoff 0",
                        help="extra flags of the ftd variant (see GOODPUT.md)")  # fmt: skip
    parser.add_argument("--ftd-every", default="auto",
                        help="--checkpoint-every of the ftd variants (cost phase: 1)")  # fmt: skip
    parser.add_argument("--cost-blocks", type=int, default=8)
    parser.add_argument("--cost-block", type=int, default=20)
    parser.add_argument(
        "--baseline-steps",
        type=int,
        default=40,
        help="plain steps just before each variant (its adjacent step time)",
    )
    parser.add_argument("--restore-mb", type=int, default=256)
    parser.add_argument("--restore-rounds", type=int, default=5)
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
    info = benchlib.machine()
    benchlib.print_machine(info)
    print(f"# command: {shlex.join([sys.executable, *sys.argv])}", flush=True)
    root = benchlib.fresh_dir(args.work_dir)
    results: dict[str, Any] = {"machine": info, "argv": sys.argv, "args": {}, "variants": []}
    results["cost"] = cost_phase(args, root)
    args.t_ff = results["cost"]["t_ff_s"]
    results["restore"] = restore_phase(args, root)
    results["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results["t_ff_pooled_s"] = results["cost"]["t_ff_s"]
    if not args.variants:
        report(results)
    for variant in args.variants:
        results["variants"].append(run_with_kills(variant, args, root))
        pool = results["cost"]["plain_samples"] + [
            t for run in results["variants"] for t in run["baseline_step_s"]
        ]
        results["t_ff_pooled_s"] = statistics.median(pool)
        for run in results["variants"]:
            if "wall_s" in run:
                run["goodput"] = run["steps_kept"] * results["t_ff_pooled_s"] / run["wall_s"]
        report(results)
    stamp = time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
    out = args.json or BENCH_DIR / "results" / f"goodput_{stamp}.json"
    benchlib.write_atomic(out, json.dumps(results, indent=2))
    print(f"\nresults: {out}")


if __name__ == "__main__":
    main()
