"""Where the test suite's CPU goes: a pytest plugin writing each test's CPU (its own process and
every child it reaped: daemons, zygotes, ranks) and wall time, one JSON line per test, to
$SUITE_CPU_OUT-<worker>.jsonl; `python bench/suite_cpu.py` then sums them by file.

    rm -f /tmp/suite-cpu-*
    SUITE_CPU_OUT=/tmp/suite-cpu PYTHONPATH=bench .venv/bin/pytest -q -p no:cacheprovider \\
        -n 3 -p suite_cpu
    python bench/suite_cpu.py /tmp/suite-cpu
"""

from __future__ import annotations

import collections
import glob
import json
import os
import resource
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

OUT = os.environ.get("SUITE_CPU_OUT", "/tmp/suite-cpu")


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    cpu, wall, start = _cpu(), time.monotonic(), time.time()
    yield
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    line = {
        "id": item.nodeid,
        "cpu": round(_cpu() - cpu, 2),
        "wall": round(time.monotonic() - wall, 2),
        "start": round(start, 2),
    }
    with open(f"{OUT}-{worker}.jsonl", "a") as out:
        out.write(json.dumps(line) + "\n")


def main(prefix: str) -> None:
    rows: list[dict[str, Any]] = []
    for path in glob.glob(f"{prefix}-*.jsonl"):
        with open(path) as lines:
            rows.extend(json.loads(line) for line in lines)
    by_file: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for row in rows:
        entry = by_file[row["id"].split("::")[0]]
        entry[0] += row["cpu"]
        entry[1] += row["wall"]
        entry[2] += 1
    print(f"{len(rows)} tests, {sum(r['cpu'] for r in rows):.0f} CPU-s")
    for name, (cpu, wall, count) in sorted(by_file.items(), key=lambda kv: -kv[1][0])[:25]:
        print(f"{cpu:8.1f} CPU-s {wall:8.1f} s {count:4d} tests  {name}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else OUT)
