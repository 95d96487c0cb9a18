"""The daemon's CPU while its ranks print, with -r 3: their output goes through the daemon.

    python bench/rank_output.py [--mb-s 10] [--window 10] [--ranks 2] [--line-bytes 1024]
                                [--start-method zygote|spawn] [--tee] [--full-disk]

Launches `ftd serve -r 3 --nproc-per-node N` (or `-t 3` with --tee, the daemon's stdout to a
file) with this script as the ranks (no torch in them). The ranks wait for a mark, then print
lines of --line-bytes at --mb-s MB/s in all (paced every 10 ms), half of a tenth of them to
stderr, until the stop mark. The daemon's CPU time (utime+stime of all its threads, from
/proc/<pid>/stat) is sampled every second: first over an idle window (ranks up, silent), then
over --window seconds of output after a 1 s warm-up. --full-disk puts --log-dir on a 2 MiB
tmpfs (needs root) that the output fills at once: the cost of dropping. Reported: the median
and max of the one-second samples, in percent of one core, and what the ranks printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import benchlib

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb-s", type=float, default=10.0, help="all ranks together, 1e6 B/s")
    parser.add_argument("--window", type=float, default=10.0, help="measured seconds")
    parser.add_argument("--idle-window", type=float, default=3.0)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--line-bytes", type=int, default=1024)
    parser.add_argument("--start-method", default="zygote")
    parser.add_argument("--tee", action="store_true", help="-t 3 instead of -r 3")
    parser.add_argument("--full-disk", action="store_true", help="--log-dir on a full tmpfs")
    parser.add_argument("--work-dir", default="/tmp/ftd-bench/rank_output")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if benchlib.under_ftd():
        rank_main(args)
    else:
        launch(args)


# -- the rank ----------------------------------------------------------------------------------


def rank_main(args: argparse.Namespace) -> None:
    work = Path(args.work_dir)
    rank = int(os.environ["LOCAL_RANK"])
    benchlib.write_atomic(work / f"ready_{rank}", "1")
    while not (work / "go").exists():
        time.sleep(0.01)
    per_s = args.mb_s * 1e6 / args.ranks
    line = (f"r{rank} " + "x" * args.line_bytes)[: args.line_bytes - 1]
    started = time.monotonic()
    printed = lines = slowest = 0.0
    while not (work / "stop").exists():
        due = (time.monotonic() - started + 0.01) * per_s
        while printed < due:
            before = time.monotonic()
            print(line)
            if lines % 20 == 0:
                print(line, file=sys.stderr)
            slowest = max(slowest, time.monotonic() - before)
            printed += args.line_bytes
            lines += 1
        time.sleep(0.01)
    seconds = time.monotonic() - started
    report = {"seconds": seconds, "bytes": printed, "lines": lines, "slowest_print_s": slowest}
    benchlib.write_atomic(work / f"rank_{rank}.json", json.dumps(report))


# -- the launcher ------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime, stime


def per_second(pid: int, seconds: float) -> list[float]:
    """The daemon's CPU in percent of one core, one sample per second."""
    samples = []
    last_time, last_cpu = time.monotonic(), cpu_seconds(pid)
    for _ in range(round(seconds)):
        time.sleep(1.0)
        now, cpu = time.monotonic(), cpu_seconds(pid)
        samples.append(100 * (cpu - last_cpu) / (now - last_time))
        last_time, last_cpu = now, cpu
    return samples


def launch(args: argparse.Namespace) -> None:
    work = benchlib.fresh_dir(Path(args.work_dir))
    logs = work / "logs"
    logs.mkdir(mode=0o700)
    if args.full_disk:
        mount = ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(logs)]
        subprocess.run(mount, check=True)
    info = benchlib.machine()
    script_args = [f"--{k}={v}" for k, v in (("mb-s", args.mb_s), ("ranks", args.ranks))]
    script_args += ["--line-bytes", str(args.line_bytes), "--work-dir", str(work)]
    flags = ["-t" if args.tee else "-r", "3", "--start-method", args.start_method]
    cmd = [
        sys.executable, "-m", "ftd", "serve", "--api-port", "off", "--log-dir", str(logs),
        "--run-id", "out", "--nproc-per-node", str(args.ranks), "--max-restarts", "0", *flags,
        str(Path(__file__).resolve()), *script_args,
    ]  # fmt: skip
    with (work / "daemon.out").open("wb") as out, (work / "daemon.err").open("wb") as err:
        daemon = subprocess.Popen(cmd, stdout=out, stderr=err, env=benchlib.child_env())
    try:
        for rank in range(args.ranks):
            benchlib.wait_for(work / f"ready_{rank}", 120)
        time.sleep(1.0)
        idle = per_second(daemon.pid, args.idle_window)
        (work / "go").write_text("1")
        time.sleep(1.0)
        busy = per_second(daemon.pid, args.window)
        (work / "stop").write_text("1")
        code = daemon.wait(timeout=120)
    finally:
        if daemon.poll() is None:
            daemon.kill()
        if args.full_disk:
            subprocess.run(["umount", "-l", str(logs)], check=False)
    if code != 0:
        raise SystemExit(f"ftd serve exited {code}; see {work}")
    ranks = [json.loads((work / f"rank_{r}.json").read_text()) for r in range(args.ranks)]
    seconds = statistics.median(r["seconds"] for r in ranks)
    err_text = (work / "daemon.err").read_text(errors="replace")
    results: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "flags": flags,
        "ranks": args.ranks,
        "line_bytes": args.line_bytes,
        "target_mb_s": args.mb_s,
        "printed_mb_s": sum(r["bytes"] for r in ranks) / seconds / 1e6,
        "lines_per_s": sum(r["lines"] for r in ranks) / seconds,
        "slowest_print_ms": 1000 * max(r["slowest_print_s"] for r in ranks),
        "idle_cpu_percent": idle,
        "busy_cpu_percent": busy,
        "busy_median": statistics.median(busy),
        "busy_max": max(busy),
        "dropped_said": err_text.count("cannot be written"),
        "machine": info,
    }
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def report(r: dict[str, Any]) -> None:
    benchlib.print_machine(r["machine"])
    print(f"# {r['command']}")
    print(
        f"{r['ranks']} ranks, {' '.join(r['flags'])}, {r['line_bytes']} B lines: printed "
        f"{r['printed_mb_s']:.2f} MB/s ({r['lines_per_s']:.0f} lines/s), slowest print "
        f"{r['slowest_print_ms']:.1f} ms"
    )
    idle = r["idle_cpu_percent"]
    print(f"daemon CPU idle:  median {statistics.median(idle):.1f} %  max {max(idle):.1f} %")
    print(f"daemon CPU busy:  median {r['busy_median']:.1f} %  max {r['busy_max']:.1f} %")
    print("busy samples: " + " ".join(f"{v:.0f}" for v in r["busy_cpu_percent"]))
    if r["dropped_said"]:
        print(f"output_dropped episodes said: {r['dropped_said']}")


if __name__ == "__main__":
    main()
