"""How soon a rank that stops for good is judged, and whether the right rank is named, under ftd
(progress for an unmodified script, or ftd_client heartbeats) and beside ft_launcher and torchrun.

    python bench/hang_blame.py [--repeats 20] [--ft-launcher-repeats 10] [--torchrun-repeats 5]
        [--setups a b c d e] [--floor 5] [--pg-timeout 60]

The scenario (issue 25): DDP over gloo, 2 ranks, 60 steps of 20 ms, a checkpoint every 10 steps;
in attempt 0 rank 1 stops for good before step 40 (it enters nothing again) and prints the wall
time it stopped; rank 0 blocks in the next allreduce. `--max-restarts 1`: the job should resume
from the step-40 checkpoint and finish. The setups:

a. `ftd serve --start-method zygote --progress-timeout-floor 5` + tests/bin/plain_ddp.py
   (no ftd, no NVRx import: the verdict comes from the progress ftd observes inside the ranks);
b. the same with `--start-method spawn`;
c. `ftd serve` + examples/train_ddp.py (ftd_client heartbeats and sections, as `make demo`:
   rank_heartbeat_timeout=3, rank_section_timeouts=setup:120,step:10; progress on, its floor
   the default 300 s, so the heartbeat timeout judges);
d. NVIDIA's `ft_launcher` (nvidia-resiliency-ext) + bench/nvrx_hang_ddp.py (the same loop with
   NVRx's RankMonitorClient heartbeats), rank_heartbeat_timeout=3, its other settings default
   (workload_check_interval 5 s);
e. `torchrun` + plain_ddp.py --pg-timeout P (no hang detection: rank 0's allreduce fails when
   the gloo timeout runs out, then torchrun restarts the group).

Detection: from the stop line's wall time to the verdict (ftd: the rank_hung event;
ft_launcher: its first rank monitor's "Did not get subsequent heartbeat" line; torchrun: its
"failed (exitcode" line, the first moment it knows of any failure). Blame: the rank named
(ftd: rank_hung's global_rank; ft_launcher: the local rank of the monitor that timed out first;
torchrun names no hung rank, only the rank that failed). Setups run interleaved, a-e in each
repetition (d and e only in the first --ft-launcher-repeats and --torchrun-repeats), the
results JSON rewritten after each run.
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
from datetime import datetime
from pathlib import Path
from typing import Any

import benchlib

ROOT = benchlib.ROOT
PLAIN_DDP = ROOT / "tests" / "bin" / "plain_ddp.py"
TRAIN_DDP = ROOT / "examples" / "train_ddp.py"
NVRX_DDP = Path(__file__).resolve().with_name("nvrx_hang_ddp.py")
STOP_STEP = 40
STEPS = 60
RUN_LIMIT_S = 400.0
COMMON = ["--nproc-per-node", "2", "--max-restarts", "1"]
NAMES = {
    "a": "ftd zygote + plain_ddp (progress)",
    "b": "ftd spawn + plain_ddp (progress)",
    "c": "ftd + train_ddp (ftd_client heartbeats)",
    "d": "ft_launcher + nvrx_hang_ddp (NVRx heartbeats)",
    "e": "torchrun + plain_ddp (gloo timeout)",
}
STOP_AT = re.compile(r"(?:stopping for good|injected hang).*\(at (\d+\.\d+)\)")
FTD_LOG_TIME = re.compile(r"^\[ftd \w (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
TORCH_LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\] ")
GLOG_TIME = re.compile(r"^[IWEF](\d{4} \d\d:\d\d:\d\d\.\d{6}) ")  # torchrun's own lines
NVRX_TIMEOUT = re.compile(r"\[RankMonServer\d+@[^:\]]+:(\d+)\] Did not get subsequent heartbeat")
FAILED_RANK = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="runs of each ftd setup (a-c)")
    parser.add_argument("--ft-launcher-repeats", type=int, default=10, help="runs of d")
    parser.add_argument("--torchrun-repeats", type=int, default=5, help="runs of e")
    parser.add_argument("--setups", nargs="+", choices=sorted(NAMES), default=sorted(NAMES))
    parser.add_argument("--floor", type=float, default=5.0, help="--progress-timeout-floor (s)")
    parser.add_argument("--pg-timeout", type=float, default=60.0, help="torchrun's gloo timeout")
    parser.add_argument("--work-dir", default="/tmp/ftd-bench/hang_blame")
    parser.add_argument("--json", default=None, help="results file (default under bench/results)")
    parser.add_argument("--merge", nargs="+", help="combine these results files into --json")
    args = parser.parse_args()
    if args.merge:
        merge([Path(name) for name in args.merge], Path(args.json))
        return
    day = time.strftime("%Y-%m-%d", time.gmtime())
    out = Path(args.json or ROOT / "bench" / "results" / f"hang_blame_{day}.json")
    root = benchlib.fresh_dir(Path(args.work_dir))
    results: dict[str, Any] = {
        "command": [sys.executable, *sys.argv],
        "floor_s": args.floor,
        "pg_timeout_s": args.pg_timeout,
        "setups": {key: NAMES[key] for key in args.setups},
        "runs": {key: [] for key in args.setups},
        "machine": benchlib.machine(),
    }
    counts = {"a": args.repeats, "b": args.repeats, "c": args.repeats}
    counts |= {"d": args.ft_launcher_repeats, "e": args.torchrun_repeats}
    for repeat in range(max(counts.values())):
        chosen = [key for key in args.setups if repeat < counts[key]]
        for key in chosen if repeat % 2 == 0 else chosen[::-1]:
            work = benchlib.fresh_dir(root / f"r{repeat:02d}_{key}")
            run = run_once(key, work, args)
            run["repeat"], run["load_1min"] = repeat, os.getloadavg()[0]
            results["runs"][key].append(run)
            print(f"repeat {repeat} {key}: {describe(run)}", flush=True)
            results["machine"]["loadavg at end"] = benchlib._read("/proc/loadavg")
            results["summary"] = summarise(results["runs"])
            benchlib.write_atomic(out, json.dumps(results, indent=2))
    report(results)
    print(f"# results: {out}")


def merge(paths: list[Path], out: Path) -> None:
    """One results file from several runs of this script (setups run side by side)."""
    parts = [json.loads(path.read_text()) for path in paths]
    runs: dict[str, list[dict[str, Any]]] = {}
    for part in parts:
        for key, done in part["runs"].items():
            runs.setdefault(key, []).extend(done)
    keys = sorted(runs)
    merged = {
        "parts": [{k: part[k] for k in ("command", "machine")} for part in parts],
        "floor_s": parts[0]["floor_s"],
        "pg_timeout_s": parts[0]["pg_timeout_s"],
        "setups": {key: NAMES[key] for key in keys},
        "runs": {key: runs[key] for key in keys},
        "summary": summarise({key: runs[key] for key in keys}),
        "machine": parts[0]["machine"],
    }
    benchlib.write_atomic(out, json.dumps(merged, indent=2))
    report(merged)


def command(key: str, work: Path, args: argparse.Namespace) -> list[str]:
    ckpt = ["--steps", str(STEPS), "--ckpt-dir", str(work / "ckpt")]
    stop = ["--stop-at-step", str(STOP_STEP)]
    if key in "ab":
        method = "zygote" if key == "a" else "spawn"
        flags = ["--start-method", method, "--progress-timeout-floor", str(args.floor)]
        return ftd_command(work, [*COMMON, *flags, str(PLAIN_DDP), *ckpt, *stop])
    if key == "c":
        flags = ["--start-method", "zygote", "--ft-param-rank_heartbeat_timeout=3",
                 "--ft-param-rank_section_timeouts=setup:120,step:10"]  # fmt: skip
        script = [str(TRAIN_DDP), *ckpt, "--hang-at-step", str(STOP_STEP), "--step-time", "0.02"]
        return ftd_command(work, [*COMMON, *flags, *script])
    bin_dir = Path(sys.executable).parent
    if key == "d":
        timeout = ["--ft-param-rank_heartbeat_timeout=3"]
        return [str(bin_dir / "ft_launcher"), "--standalone", *COMMON, *timeout, str(NVRX_DDP),
                *ckpt, *stop]  # fmt: skip
    pg = ["--pg-timeout", str(args.pg_timeout)]
    return [str(bin_dir / "torchrun"), "--standalone", *COMMON, str(PLAIN_DDP), *ckpt, *stop, *pg]


def ftd_command(work: Path, rest: list[str]) -> list[str]:
    return [sys.executable, "-m", "ftd", "serve", "--api-port", "off", "--log-dir", str(work),
            "--run-id", "run", *rest]  # fmt: skip


def run_once(key: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = {**benchlib.child_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = command(key, work, args)
    started = time.time()
    with (work / "out").open("wb") as out, (work / "err").open("wb") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)  # fmt: skip
        try:
            code = proc.wait(timeout=RUN_LIMIT_S)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    run: dict[str, Any] = {"exit_code": code, "wall_s": time.time() - started, "dir": str(work)}
    stdout = (work / "out").read_text(errors="replace")
    stops = [float(m[1]) for m in STOP_AT.finditer(stdout)]
    finished = f"finished {STEPS} steps"
    run["finished"] = code == 0 and finished in stdout
    if not stops:
        run["error"] = "no stop line"
        return run
    stop = stops[0]
    try:
        verdict, named, extra = (
            ftd_verdict(work) if key in "abc" else peer_verdict(key, work / "err")
        )
    except (ValueError, FileNotFoundError, KeyError) as error:
        run["error"] = str(error)
        return run
    run |= {"stop_at": stop, "detection_s": verdict - stop, "named_rank": named, **extra}
    for mark in ("verdict_logged_at", "failure_seen_at"):
        if run.get(mark) is not None:
            run[mark.replace("_at", "_s_after_stop")] = run[mark] - stop
    run["within_20s"] = run["detection_s"] <= 20.0
    return run


def ftd_verdict(work: Path) -> tuple[float, int, dict[str, Any]]:
    events = benchlib.events(work / "run")
    hung = [e for e in events if e["kind"] == "rank_hung"]
    if not hung:
        raise ValueError("no rank_hung event")
    first = hung[0]
    logged = log_time(FTD_LOG_TIME, work / "err", first["data"]["reason"][:60])
    stacks = [(work / "run" / "attempt_0" / str(r) / "stacks.txt").exists() for r in (0, 1)]
    return (
        first["time"],
        int(first["data"]["global_rank"]),
        {
            "verdict_logged_at": logged,
            "culprit": first["data"].get("culprit"),
            "victims": first["data"].get("victims"),
            "rank_hung_events": [e["data"]["global_rank"] for e in hung],
            "reason": first["data"]["reason"],
            "stacks_written": stacks,
        },
    )


def peer_verdict(key: str, err: Path) -> tuple[float, int, dict[str, Any]]:
    text = err.read_text(errors="replace")
    failed = [(line, FAILED_RANK.search(line)) for line in text.splitlines()]
    failed_lines = [(line, m) for line, m in failed if m is not None]
    if not failed_lines:
        raise ValueError("no 'failed (exitcode' line")
    line, match = failed_lines[0]
    extra: dict[str, Any] = {
        "failed_local_rank": int(match[2]),
        "failed_exit_code": int(match[1]),
        "failure_seen_at": line_time(line),
    }
    if key == "e":  # torchrun: no hang verdict; its first act on the failure is what it knows
        acts = [line for line in text.splitlines() if "closing signal" in line]
        seen = min([extra["failure_seen_at"], *(line_time(line) for line in acts[:1])])
        return seen, -1, extra
    timeouts = [(line, NVRX_TIMEOUT.search(line)) for line in text.splitlines()]
    found = [(line, m) for line, m in timeouts if m is not None]
    if not found:
        raise ValueError("no 'Did not get subsequent heartbeat' line")
    extra["timed_out_local_ranks"] = [int(m[1]) for _, m in found]
    return line_time(found[0][0]), int(found[0][1][1]), extra


def line_time(line: str) -> float:
    """The local time a launcher's log line was written (NVRx's or torchrun's glog format)."""
    match = TORCH_LOG_TIME.match(line)
    if match is not None:
        return datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    match = GLOG_TIME.match(line)
    if match is None:
        raise ValueError(f"no time in {line!r}")
    year = time.localtime().tm_year
    return datetime.strptime(f"{year}{match[1]}", "%Y%m%d %H:%M:%S.%f").timestamp()


def log_time(pattern: re.Pattern[str], path: Path, needle: str) -> float | None:
    for line in path.read_text(errors="replace").splitlines():
        match = pattern.match(line)
        if match is not None and needle in line:
            return datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def describe(run: dict[str, Any]) -> str:
    if "error" in run:
        return f"ERROR {run['error']} (exit {run['exit_code']}, {run['dir']})"
    return (
        f"detected {run['detection_s']:.2f} s after the stop, named rank {run['named_rank']}, "
        f"finished {run['finished']}, wall {run['wall_s']:.1f} s"
    )


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for key, done in runs.items():
        detections = [r["detection_s"] for r in done if "detection_s" in r]
        table[key] = {
            "name": NAMES[key],
            "runs": len(done),
            "errors": sum("error" in r for r in done),
            "detection_median_s": statistics.median(detections) if detections else None,
            "detection_min_s": min(detections, default=None),
            "detection_max_s": max(detections, default=None),
            "within_20s": sum(bool(r.get("within_20s")) for r in done),
            "named_rank_1": sum(r.get("named_rank") == 1 for r in done),
            "finished": sum(bool(r["finished"]) for r in done),
        }
        if key == "e":
            table[key]["failed_local_ranks"] = [r.get("failed_local_rank") for r in done]
    return table


def report(results: dict[str, Any]) -> None:
    benchlib.print_machine(results["machine"])
    print("| setup | runs | detection median | max | within 20 s | rank 1 named | finished |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for key, row in results["summary"].items():
        n = row["runs"]
        median, top = row["detection_median_s"], row["detection_max_s"]
        named = "n/a" if key == "e" else f"{row['named_rank_1']}/{n}"
        print(
            f"| {row['name']} | {n} | {fmt(median)} | {fmt(top)} | {row['within_20s']}/{n} | "
            f"{named} | {row['finished']}/{n} |"
        )


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


if __name__ == "__main__":
    main()
