"""bench/SCALE.md's table in one command: bench/scale.py for each backend and size, one after
another (each run has the machine to itself), each JSON kept, the table printed in Markdown.

    python bench/scale_table.py --out DIR [--nodes 64 256 1024 4096] [--backends c10d etcd]
        [--keepalive 30] [--seconds 20] [--rounds 2]

A run that exists in DIR already (DIR/<backend>-<nodes>.json) is not made again: delete it to
measure again. `--table-only` prints the table of what DIR holds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LARGE = 4096
"""From this size a run is made lighter for this 2-core machine: 64 worker processes, one
restart and one hang, the looks stopped after the steady window (bench/SCALE.md)."""
ETCD_LARGE = ["--etcd-read-timeout", "30"]
"""etcd from 1,024 nodes as bench/SCALE.md tells an operator to run it (`--rdzv-conf
read_timeout=30`): at ftd's default of 5 s, 3 members on this machine's 2 cores answered a
round's close (1,024 join records read, the record written) later than a try's share of it."""

COLUMNS = (
    ("backend", lambda r: r["backend"]),
    ("nodes", lambda r: f"{r['nodes']:,}"),
    ("round formed (s)", lambda r: r.get("round_formed_s")),
    ("propagation p50 / p99 / max (s)", lambda r: triple(r.get("propagation_s"))),
    ("culprit named, worst (s)", lambda r: culprit(r.get("culprit"))),
    ("node lost (s)", lambda r: (r.get("node_lost_s") or {}).get("max")),
    ("store ops /s /node", lambda r: r.get("steady_store_ops_per_s_per_node")),
    ("store CPU (cores)", lambda r: r.get("store_host_cpu")),
    ("store RSS (MiB)", lambda r: r.get("store_host_rss_mb")),
    ("cluster page (KiB / s)", lambda r: page(r)),
    ("saturated", lambda r: "**yes**" if r.get("saturated") else "no"),
)


def triple(p: dict[str, Any] | None) -> str | None:
    return None if not p else f"{p['p50']:.3f} / {p['p99']:.3f} / {p['max']:.3f}"


def culprit(c: dict[str, Any] | None) -> str | None:
    """The worst time of the hangs named right on every node, and how many of them were."""
    if not c or c.get("named_after_s") is None:
        return None
    runs = c.get("runs") or [c]
    times = [r["named_after_s"] for r in runs if r.get("right")]
    worst = f"{max(times):.3f}" if times else "none right"
    after = [(r.get("steps") or {}).get("named_after_last_end_s") for r in runs if r.get("right")]
    tail = ""
    if after and None not in after:
        tail = f"; {max(after):.2f} after the last end"  # the naming apart from the end's spread
    return f"{worst} ({len(times)} of {len(runs)} right{tail})"


def page(r: dict[str, Any]) -> str | None:
    if r.get("cluster_view_bytes") is None:
        return None
    most = f" (max {r['cluster_view_max_s']:.3f})" if "cluster_view_max_s" in r else ""
    return f"{r['cluster_view_bytes'] / 1024:.1f} / {r['cluster_view_s']:.3f}{most}"


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(name for name, _ in COLUMNS) + " |"]
    lines.append("|" + "---|" * len(COLUMNS))
    for r in results:
        cells = [cell(r) for _, cell in COLUMNS]
        lines.append("| " + " | ".join("—" if c is None else str(c) for c in cells) + " |")
        if r.get("error"):
            lines.append(f"|  | ↳ {r['error'][:200]} |" + " |" * (len(COLUMNS) - 2))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--nodes", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--backends", nargs="+", default=["c10d", "etcd"])
    parser.add_argument("--keepalive", type=float, default=30.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for nodes in args.nodes:
        for backend in args.backends:
            path = args.out / f"{backend}-{nodes}.json"
            if not path.exists() and not args.table_only:
                large = ["--procs", "64", "--rounds", "1", "--hangs", "1", "--quiet-events"]
                subprocess.run(
                    [sys.executable, str(HERE / "scale.py"), "--backend", backend,
                     "--nodes", str(nodes), "--keepalive", str(args.keepalive),
                     "--seconds", str(args.seconds), "--rounds", str(args.rounds),
                     "--json", str(path), *(large if nodes >= LARGE else []),
                     *(ETCD_LARGE if backend == "etcd" and nodes >= 1024 else [])],
                    check=False, stdout=subprocess.DEVNULL,
                )  # fmt: skip
            if path.exists():
                results.append(json.loads(path.read_text()))
    print(table(results))


if __name__ == "__main__":
    main()
