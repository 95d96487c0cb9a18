"""The scale harness (bench/scale.py) in a small configuration, so that it cannot rot: 8 virtual
nodes against ftd's store in a process of its own, a short steady window; its JSON carries the
figures bench/SCALE.md reports, and the steady load is the cost model's (a few store operations
per node per second, not one per other node)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.mark.timeout(120)
def test_eight_virtual_nodes_form_a_round_and_load_the_store_a_little(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale.py"), "--backend", "c10d", "--nodes", "8",
         "--seconds", "4", "--json", str(out)],
        capture_output=True, text=True, timeout=110, cwd=ROOT,
        env={"PYTHONPATH": f"{ROOT}:{ROOT / 'client'}", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["nodes"], result["backend"]) == (8, "c10d")
    assert result["round_formed_s"] >= 0 and result["cluster_view_bytes"] <= 64 * 1024
    # 8/K + 0.9 at K = 5 s (bench/SCALE.md), with room for a busy machine's joins and waits.
    assert 1.0 <= result["steady_store_ops_per_s_per_node"] <= 5.0, result
    for figure in ("store_host_cpu", "store_host_rss_mb", "cluster_view_s", "saturated"):
        assert figure in result
