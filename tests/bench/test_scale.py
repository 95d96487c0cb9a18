"""The scale harness (bench/scale.py) in a small configuration, so that it cannot rot: 8 virtual
nodes over 2 worker processes against ftd's store in a process of its own (and against an etcd
cluster of 3 members), a short steady window, 2 restarts timed, a hang's culprit named, one
worker SIGKILLed. Its JSON carries every figure bench/SCALE.md reports: the steady load is the
cost model's (a few store operations per node per second, not one per other node), every
node's `ended` was timed after each request, every node learned the one culprit (the hung
node and rank), and every survivor heard of the kill through node rank 0's liveness.

No sleeps here: the harness's steps each wait for what they measure (a join, a future, a
process's answer), bounded; only its steady window is a fixed span of time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.support.etcd_cluster import etcd_unusable

NODES, PROCS, ROUNDS, KEEPALIVE_S = 8, 2, 2, 3


def scale(tmp_path: Path, backend: str, *extra: str) -> dict[str, Any]:
    out = tmp_path / "scale.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale.py"), "--backend", backend,
         "--nodes", str(NODES), "--procs", str(PROCS), "--rounds", str(ROUNDS),
         "--keepalive", str(KEEPALIVE_S), "--seconds", "2", "--json", str(out), *extra],
        capture_output=True, text=True, timeout=100, cwd=ROOT,
        env={"PYTHONPATH": f"{ROOT}:{ROOT / 'client'}", "PATH": "/usr/bin:/bin",
             "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    assert "error" not in result, result
    return result


def check(result: dict[str, Any], backend: str) -> None:
    assert (result["nodes"], result["backend"], result["procs"]) == (NODES, backend, PROCS)
    assert result["formed"] and result["round_formed_s"] >= 0
    assert len(result["later_rounds_formed_s"]) == ROUNDS
    # Where each round's forming went, from the last joiner's ask: its close (the last joiner
    # closes a full round; absent where the record came first and its close's wait was
    # dropped), every node's closing record, every node's round.
    for steps in (result["forming"]["steps"], *result["later_rounds_steps"]):
        assert steps.get("closed_s", 0) >= 0, steps
        assert steps["record"]["max"] <= steps["had"]["max"], steps
        assert steps["record"]["p50"] <= steps["had"]["p50"], steps
    assert abs(result["forming"]["steps"]["had"]["max"] - result["round_formed_s"]) < 0.002
    # Every node's round end timed after each restart request, none before it was made.
    propagation = result["propagation_s"]
    assert propagation["samples"] == NODES * ROUNDS, result
    assert 0 <= propagation["p50"] <= propagation["p99"] <= propagation["max"] < 60
    steps = result["propagation_steps"]
    assert len(steps) == ROUNDS, result
    assert all(s["request_s"] >= 0 and s["first_end_s"] <= s["last_end_s"] for s in steps), steps
    # The killed worker's 4 nodes: node rank 0 heard of them (the first is enough to end the
    # round), every survivor's round ended.
    lost = result["node_lost_s"]
    assert (lost["victims"], lost["survivors"]) == (NODES // PROCS, NODES - NODES // PROCS)
    assert lost["told"] == lost["survivors"] and 1 <= lost["node_lost_calls"] <= lost["victims"]
    # Not long before the keepalive timeout: liveness (a lease) outlives the last beat by K at
    # most, a kill comes up to one beat's interval after it (K/3).
    assert KEEPALIVE_S * 0.6 <= lost["detected_s"] <= lost["p50"] <= lost["max"] < 60
    assert result["false_node_lost"] == 0
    # The cost model (bench/SCALE.md), counted at the store: 6/K + 0.53 under c10d, 2.5 at
    # K = 3 s; etcd's 3/K + 0.53 (its lease's keepalives included), 1.5. Room for a busy
    # machine's waits.
    assert 0.5 <= result["steady_store_ops_per_s_per_node"] <= 8.0, result
    if backend == "etcd":
        assert result["store_requests_by_kind"]["LeaseKeepAlive"] > 0, result
    assert 0 < result["cluster_view_bytes"] <= 64 * 1024 and result["cluster_view_s"] >= 0
    assert result["store_host_cpu"] >= 0 and result["store_host_rss_mb"] > 0
    # The store's wait for a core, measured (its threads real-time where the harness may).
    assert result["store_host_waited_s"] >= 0 and result["forming"]["store_waited_s"] >= 0
    assert isinstance(result["store_prioritized"], bool)
    assert 0 <= result["cluster_view_alone_s"] <= result["cluster_view_alone_max_s"]
    # The pages come from node 0's kept view: at least one read of every summary behind them.
    assert result["cluster_view_reads"] >= 1 and result["cluster_view_read_s"] > 0, result
    assert result["cluster_view_alone_read_s"] is None or result["cluster_view_alone_read_s"] > 0
    culprit = result["culprit"]
    assert culprit["right"] and culprit["decisions"] == 1, culprit
    assert culprit["node"] == culprit["hung"]["node"] and culprit["rank"] % 8 == 3, culprit
    assert culprit["nodes_told"] == NODES and 0 <= culprit["named_after_s"] < 60, culprit
    assert isinstance(result["saturated"], bool) and isinstance(result["saturated_why"], list)


@pytest.mark.timeout(120)
def test_eight_virtual_nodes_over_two_processes_on_the_c10d_store(tmp_path: Path) -> None:
    # With the looks stopped before the events, as the 4,096-node rows run: the events hold.
    result = scale(tmp_path, "c10d", "--quiet-events", "--list-max", "4")
    assert result["looks_in_events"] is False
    check(result, "c10d")


@pytest.mark.timeout(120)
def test_eight_virtual_nodes_over_two_processes_on_etcd(tmp_path: Path) -> None:
    if (why := etcd_unusable()) is not None:
        pytest.skip(why)
    check(scale(tmp_path, "etcd", "--list-max", "4"), "etcd")
