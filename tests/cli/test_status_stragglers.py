"""`ftd status` names the cluster's stragglers under the node table (ftd/cli/status_view.py),
and a record that holds garbage where a straggler belongs shows nothing of it."""

from __future__ import annotations

import time

from ftd.cli.status_view import cluster_lines
from ftd.text import NO_VALUE

SINCE = time.mktime((2026, 11, 26, 8, 20, 11, 0, 0, -1))
NODES = [{"node_id": "a", "state": "running"}, {"node_id": "b", "state": "running"}]


def test_the_cluster_lines_name_each_straggler_with_its_node_and_ratio() -> None:
    straggler = {"node_id": "b", "global_rank": 1, "ratio": 1.93, "since": SINCE}
    lines = cluster_lines({}, {"nodes": NODES, "stragglers": [straggler]})
    assert lines[-1] == "stragglers: rank 1 on b (1.9x the job's median forward, since 08:20:11)"


def test_no_stragglers_no_line_and_garbage_is_skipped() -> None:
    assert not any("stragglers" in line for line in cluster_lines({}, {"nodes": NODES}))
    odd = {"nodes": NODES, "stragglers": ["x", 3, {"global_rank": "\x1b[2J", "since": "y"}]}
    [line] = [line for line in cluster_lines({}, odd) if line.startswith("stragglers")]
    assert "\x1b" not in line and line.endswith(f"since {NO_VALUE})"), line
