"""The daemon's CPU and memory while 8 ranks heartbeat at 100 Hz each.

    python bench/daemon_load.py [--ranks 8] [--hz 100] [--window 60] [--no-sections]

Launches `ftd serve --nproc-per-node 8` with this script as the ranks (no torch in them). The
ranks connect (hello), then wait; the daemon is first sampled over an idle window (ranks
connected, silent), then the ranks beat at --hz, each beat a heartbeat plus, unless
--no-sections, a start_section/end_section pair (3 messages a beat; each message is one
packet on the rank's own SOCK_SEQPACKET connection to the daemon). After a warm-up the
daemon's CPU time (utime+stime of every thread, /proc/<pid>/stat) and VmRSS
(/proc/<pid>/status) are read at the start and end of a --window second window. The daemon
writes its receive counter only on state changes, so the ranks count what they sent (and what
the client dropped) between the window's start and end marks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import benchlib

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--hz", type=float, default=100.0)
    parser.add_argument("--window", type=float, default=60.0, help="measured seconds")
    parser.add_argument("--idle-window", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--no-sections", action="store_true")
    parser.add_argument("--work-dir", default="/tmp/ftd-bench/daemon_load")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if benchlib.under_ftd():
        rank_main(args)
    else:
        launch(args)


# -- the rank ----------------------------------------------------------------------------------


def rank_main(args: argparse.Namespace) -> None:
    from ftd_client import RankClient

    work = Path(args.work_dir)
    rank = int(os.environ["RANK"])
    client = RankClient()
    benchlib.write_atomic(work / f"ready_{rank}", "1")
    while not (work / "go").exists():
        time.sleep(0.01)
    sections = not args.no_sections
    per_beat = 3 if sections else 1
    interval = 1.0 / args.hz
    beats = 0
    marks: dict[str, dict[str, float]] = {}
    next_beat = time.monotonic()
    while True:
        client.heartbeat()
        if sections:
            client.start_section("step")
            client.end_section("step")
        beats += 1
        if beats % 10 == 0:  # look for the launcher's marks ten times a second
            for mark in ("start", "stop"):
                if mark not in marks and (work / mark).exists():
                    marks[mark] = {
                        "time": time.monotonic(),
                        "sent": beats * per_beat,
                        "dropped": client.dropped,
                    }
            if "stop" in marks:
                break
        next_beat += interval
        delay = next_beat - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            next_beat = time.monotonic()  # late: beat now, do not burst to catch up
    client.close()
    start, stop = marks["start"], marks["stop"]
    benchlib.write_atomic(
        work / f"rank_{rank}.json",
        json.dumps(
            {
                "seconds": stop["time"] - start["time"],
                "sent": stop["sent"] - start["sent"],
                "dropped": stop["dropped"] - start["dropped"],
                "beats_total": beats,
            }
        ),
    )


# -- the launcher ------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime, stime


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def sample(pid: int) -> tuple[float, float, float]:
    return time.monotonic(), cpu_seconds(pid), rss_mb(pid)


def cpu_percent(first: tuple[float, float, float], last: tuple[float, float, float]) -> float:
    return 100 * (last[1] - first[1]) / (last[0] - first[0])


def launch(args: argparse.Namespace) -> None:
    work = benchlib.fresh_dir(Path(args.work_dir))
    info = benchlib.machine()
    script_args = [
        "--hz", str(args.hz), "--work-dir", str(work),
        *(["--no-sections"] if args.no_sections else []),
    ]  # fmt: skip
    daemon = benchlib.serve(
        work, "load", Path(__file__).resolve(), script_args,
        "--nproc-per-node", str(args.ranks), "--max-restarts", "0",
        "--ft-param-initial_rank_heartbeat_timeout=600",
        "--ft-param-rank_heartbeat_timeout=10",
    )  # fmt: skip
    pid = daemon.pid
    try:
        for rank in range(args.ranks):
            benchlib.wait_for(work / f"ready_{rank}", 120)
        time.sleep(1.0)  # the hellos handled, the loop settled
        idle0 = sample(pid)
        time.sleep(args.idle_window)
        idle1 = sample(pid)
        (work / "go").write_text("1")
        time.sleep(args.warmup)
        busy0 = sample(pid)
        (work / "start").write_text("1")
        time.sleep(args.window)
        busy1 = sample(pid)
        (work / "stop").write_text("1")
        code = daemon.wait(timeout=120)
    finally:
        if daemon.poll() is None:
            daemon.kill()
    if code != 0:
        raise SystemExit(f"ftd serve exited {code}; see {work}")
    ranks = [json.loads((work / f"rank_{r}.json").read_text()) for r in range(args.ranks)]
    sent = sum(r["sent"] for r in ranks)
    dropped = sum(r["dropped"] for r in ranks)
    seconds = statistics.median(r["seconds"] for r in ranks)
    results: dict[str, Any] = {
        "ranks": args.ranks,
        "hz": args.hz,
        "messages_per_beat": 1 if args.no_sections else 3,
        "window_s": busy1[0] - busy0[0],
        "idle_window_s": idle1[0] - idle0[0],
        "idle_cpu_percent": cpu_percent(idle0, idle1),
        "busy_cpu_percent": cpu_percent(busy0, busy1),
        "rss_mb": {"idle": idle0[2], "window_start": busy0[2], "window_end": busy1[2]},
        "sent": sent,
        "dropped": dropped,
        "messages_per_s": sent / seconds,
        "heartbeats_per_s": sent / seconds / (1 if args.no_sections else 3),
        "per_rank_sent": [r["sent"] for r in ranks],
        "daemon_ipc": daemon_ipc(work / "load"),
        "machine": info,
    }
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def daemon_ipc(run_dir: Path) -> dict[str, Any]:
    """The daemon's own counters at its exit: messages received (the whole run, not only the
    window) and dropped by cause (malformed, not from a rank, section not open...)."""
    try:
        status = json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}
    return dict(status.get("ipc") or {})


def report(r: dict[str, Any]) -> None:
    benchlib.print_machine(r["machine"])
    print(
        f"# {r['ranks']} ranks x {r['hz']:g} Hz, {r['messages_per_beat']} message(s) a beat, "
        f"window {r['window_s']:.1f} s (idle window {r['idle_window_s']:.1f} s)"
    )
    print(f"daemon CPU, ranks connected but silent: {r['idle_cpu_percent']:6.2f} % of one core")
    print(f"daemon CPU, ranks beating:              {r['busy_cpu_percent']:6.2f} % of one core")
    rss = r["rss_mb"]
    print(
        f"daemon RSS: {rss['idle']:.1f} MB idle, {rss['window_start']:.1f} MB at the window's "
        f"start, {rss['window_end']:.1f} MB at its end"
    )
    print(
        f"sent {r['sent']} messages ({r['messages_per_s']:.0f}/s, {r['heartbeats_per_s']:.0f} "
        f"beats/s), dropped {r['dropped']}"
    )
    ipc = r["daemon_ipc"]
    print(
        f"daemon's counters at exit (whole run): received {ipc.get('received', '?')}, "
        f"dropped {ipc.get('dropped', '?')}"
    )
    print(
        f"CPU per 1000 messages/s: "
        f"{r['busy_cpu_percent'] / (r['messages_per_s'] / 1000):.2f} % of a core"
    )
    print(
        "ft_launcher (published): one monitor process per rank at ~20 % of a core -> "
        f"~{20 * r['ranks']} % for {r['ranks']} ranks; ftd: "
        f"{r['busy_cpu_percent']:.1f} % ({20 * r['ranks'] / r['busy_cpu_percent']:.0f}x less)"
    )


if __name__ == "__main__":
    main()
