"""Issue 28's burst scenario, many times: a lost message must never kill a healthy rank.

    python bench/burst_runs.py --runs 25 --nproc 4 [--stop-s 3] [--hang-runs 10]
        [--checkout DIR]   # another ftd checkout (say, an older commit) for a same-run baseline

Each daemon run: `ftd serve --standalone --nproc-per-node NPROC --max-restarts 0
--ft-param-rank_heartbeat_timeout=30 --ft-param-rank_section_timeouts=step:3` with
tests/bin/burst_rank.py: every rank opens and closes section `step` --sections times in a row
(3000: the issue's figure), then heartbeats outside any section for 4 s (past the 3 s timeout:
a section the daemon wrongly believed open would be judged), then exits 0. Both start methods;
plain, and with the daemon SIGSTOPped for --stop-s seconds as the first rank begins its burst
(30000 sections then, so the burst outlasts the stop). A rank-run passes when its daemon exits 0
with no `rank_hung`.

With --hang-runs, also: a rank bursts 30000 sections, then opens `step` and hangs; the figure is
the time from the rank's `start_section` to the `rank_hung` event (goal: 3 s + 20 ms).
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
from pathlib import Path
from typing import Any

import benchlib

BURST = benchlib.ROOT / "tests" / "bin" / "burst_rank.py"
FLAGS = ("--ft-param-rank_heartbeat_timeout=30", "--ft-param-rank_section_timeouts=step:3")


def env_for(checkout: Path | None) -> dict[str, str]:
    env = benchlib.child_env()
    if checkout is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(checkout), str(checkout / "client")])
    return env


def one_run(
    work: Path, run_id: str, method: str, nproc: int, stop_s: float, script_args: list[str],
    checkout: Path | None,
) -> dict[str, Any]:  # fmt: skip
    cmd = [
        sys.executable, "-m", "ftd", "serve", "--api-port", "off", "--log-dir", str(work),
        "--run-id", run_id, "--standalone", "--nproc-per-node", str(nproc),
        "--max-restarts", "0", "--start-method", method, *FLAGS, str(BURST), *script_args,
    ]  # fmt: skip
    out_path = work / f"{run_id}.out"
    with out_path.open("wb") as out, (work / f"{run_id}.err").open("wb") as err:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env_for(checkout),
            cwd=str(checkout or benchlib.ROOT),
        )  # fmt: skip
        if stop_s > 0:
            deadline = time.monotonic() + 120
            while b"bursting" not in out_path.read_bytes() and time.monotonic() < deadline:
                time.sleep(0.005)
            proc.send_signal(signal.SIGSTOP)
            time.sleep(stop_s)
            proc.send_signal(signal.SIGCONT)
        code = proc.wait(timeout=300)
    events = benchlib.events(work / run_id)
    text = out_path.read_text()
    dropped = [int(n) for n in re.findall(r"(?<!burst) done, dropped (\d+)", text)]
    hung = [e for e in events if e["kind"] == "rank_hung"]
    lost = [e["data"].get("lost", 0) for e in events if e["kind"] == "messages_lost"]
    result: dict[str, Any] = {
        "exit": code, "hung": len(hung), "dropped": dropped, "lost_events": len(lost),
    }  # fmt: skip
    if "--hang" in script_args and hung:
        starts = [float(x.split()[0]) for x in text.split("hanging in step at ")[1:]]
        result["judged_after_s"] = hung[0]["time"] - min(starts)
        result["section"] = hung[0]["data"].get("section")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=25, help="daemon runs per configuration")
    parser.add_argument("--nproc", type=int, default=4, help="bursting ranks per daemon")
    parser.add_argument("--stop-s", type=float, default=3.0)
    parser.add_argument("--hang-runs", type=int, default=0)
    parser.add_argument("--checkout", type=Path, default=None)
    parser.add_argument("--methods", default="zygote,spawn")
    parser.add_argument("--work", type=Path, default=Path("/tmp/ftd-burst-runs"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    work = benchlib.fresh_dir(args.work)
    info = benchlib.machine()
    benchlib.print_machine(info)
    print(f"# checkout: {args.checkout or benchlib.ROOT}", flush=True)
    report: dict[str, Any] = {"machine": info, "configs": {}}
    for method in args.methods.split(","):
        for stop_s, sections in ((0.0, "3000"), (args.stop_s, "30000")):
            name = f"{method}, " + (f"SIGSTOP {stop_s:g} s" if stop_s else "plain")
            runs = []
            for i in range(args.runs):
                script_args = ["--sections", sections, "--quiet-s", "4"]
                run_id = f"{method}-{'stop' if stop_s else 'plain'}-{i}"
                runs.append(
                    one_run(work, run_id, method, args.nproc, stop_s, script_args, args.checkout)
                )
            ok = sum(args.nproc for r in runs if r["exit"] == 0 and r["hung"] == 0)
            drops = [d for r in runs for d in r["dropped"]]
            row = {
                "rank_runs": args.nproc * args.runs,
                "rank_runs_ok": ok,
                "hang_verdicts": sum(r["hung"] for r in runs),
                "dropped_median": statistics.median(drops) if drops else None,
                "dropped_max": max(drops) if drops else None,
                "loss_events": sum(r["lost_events"] for r in runs),
            }
            report["configs"][name] = row
            print(f"{name}: {json.dumps(row)}", flush=True)
        hangs = []
        for i in range(args.hang_runs):
            run_id = f"{method}-hang-{i}"
            result = one_run(
                work, run_id, method, 1, 0.0, ["--sections", "30000", "--hang"], args.checkout
            )
            if "judged_after_s" in result:
                hangs.append(result)
        if hangs:
            late = [1000 * (h["judged_after_s"] - 3.0) for h in hangs]
            row = {
                "runs": len(hangs),
                "by_step": sum(h.get("section") == "step" for h in hangs),
                "late_ms_median": round(statistics.median(late), 1),
                "late_ms_max": round(max(late), 1),
            }
            report["configs"][f"{method}, hang in step after a burst"] = row
            print(f"{method}, hang in step after a burst: {json.dumps(row)}", flush=True)
    if args.json is not None:
        benchlib.write_atomic(args.json, json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
