"""`ftd status` names the cluster's stragglers under the node table (ftd/cli/status_view.py),
and a record that holds garbage where a straggler belongs shows nothing of it."""

from __future__ import annotations

import time

from ftd.cli.cluster_lines import cluster_lines, straggler_text
from ftd.cli.status_view import RANK_HEADER, rank_rows
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


def test_the_ranks_table_marks_a_straggler_by_how_much_in_what_since_when() -> None:
    host = {"straggler": {"ratio": 1.93, "since": SINCE, "signal": "host"}}
    assert straggler_text(host) == "1.9x host time since 08:20:11"
    forward = {"straggler": {"ratio": 3.0, "since": SINCE, "signal": "forward"}}
    assert straggler_text(forward) == "3.0x forward since 08:20:11"
    assert straggler_text({"straggler": None}) == NO_VALUE
    odd = {"straggler": {"ratio": 2.5, "since": "x", "signal": "\x1b[2J"}}
    assert straggler_text(odd) == f"2.5x {NO_VALUE} since {NO_VALUE}"
    status = {"ranks": [{"local_rank": 0, "global_rank": 1, "progress": host}]}
    [row] = rank_rows(status)
    assert row[RANK_HEADER.index("STRAGGLER")] == "1.9x host time since 08:20:11"
    straggler = {"node_id": "b", "global_rank": 1, "ratio": 1.93, "since": SINCE, "signal": "host"}
    lines = cluster_lines({}, {"nodes": NODES, "stragglers": [straggler]})
    assert lines[-1] == "stragglers: rank 1 on b (1.9x the job's median host time, since 08:20:11)"
