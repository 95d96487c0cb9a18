"""`GET /v1/cluster` stays small at thousands of nodes (issue 43, item 6): a page of nodes and
the aggregates over all of them, within 64 KiB by default; bad paging is a 400 problem."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ftd.api.cluster_view import DEFAULT_LIMIT, WORST, bounded
from ftd.cli.cluster_lines import cluster_lines, more_nodes_lines
from tests.conftest import ServeFactory
from tests.support.api import api_of, stop

NODES = 4096


def summary(index: int) -> dict[str, Any]:
    """A node's summary as the coordinators decode it: 8 ranks' forward and host times."""
    return {
        "node_id": f"node-{index:05d}",
        "state": "running" if index % 97 else "restarting",
        "role": "standby" if index >= NODES - 8 else "active",
        "attempt": 3,
        "restart_count": 2,
        "group_rank": index,
        "round": 3,
        "nproc_per_node": 8,
        "ranks_running": 8,
        "ranks_total": 8,
        "last_failure": None,
        "time": 1_800_000_000.0 + (index * 7919) % NODES,
        "forward": [
            {"global_rank": 8 * index + r, "forward_us": 51_000, "host_us": 2_100} for r in range(8)
        ],
        "stragglers": [],
    }


def cluster(nodes: int) -> dict[str, Any]:
    every = [summary(i) for i in range(nodes)]
    stragglers = [
        {"node_id": f"node-{i:05d}", "global_rank": 8 * i, "ratio": 1.2 + i / 1000, "since": 1.0}
        for i in range(0, nodes, 13)
    ]
    return {
        "nodes": every,
        "round": {"round": 3, "members": [n["node_id"] for n in every]},
        "excluded": [],
        "stragglers": stragglers,
        "store_ops": 123,
        "refused_records": {},
    }


def test_4096_nodes_fit_in_64_kib_with_the_aggregates_over_all_of_them() -> None:
    view = cluster(NODES)
    answer = bounded(view, 0, DEFAULT_LIMIT)
    size = len(json.dumps(answer).encode())
    assert size <= 64 * 1024, size
    assert answer["total_nodes"] == NODES and len(answer["nodes"]) == DEFAULT_LIMIT
    assert all("forward" not in node for node in answer["nodes"])
    assert answer["counts"]["state"] == {"restarting": 43, "running": NODES - 43}
    assert answer["counts"]["role"] == {"active": NODES - 8, "standby": 8}
    ratios = [s["ratio"] for s in answer["stragglers"]]
    assert len(ratios) == WORST and ratios == sorted(ratios, reverse=True)
    assert answer["total_stragglers"] == len(view["stragglers"])
    lagging = [node["time"] for node in answer["lagging"]]
    assert len(lagging) == WORST and lagging == sorted(lagging)
    assert lagging[0] == min(n["time"] for n in view["nodes"])
    last = bounded(view, NODES - 6, DEFAULT_LIMIT)
    tail = [f"node-{i:05d}" for i in range(NODES - 6, NODES)]
    assert [n["node_id"] for n in last["nodes"]] == last["round"]["members"] == tail
    assert last["round"]["size"] == NODES and answer["round"]["round"] == 3
    assert bounded(view, NODES + 5, 10)["nodes"] == []


json_values = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(
    nodes=st.lists(
        st.dictionaries(
            st.sampled_from(["state", "role", "time", "node_id", "forward"]), json_values
        ),
        max_size=8,
    )
    | json_values,
    stragglers=st.lists(
        st.dictionaries(st.sampled_from(["ratio", "node_id"]), json_values), max_size=8
    )
    | json_values,
    round_=json_values,
    offset=st.integers(0, 10),
    limit=st.integers(1, 10),
)
def test_whatever_the_view_holds_the_page_is_made_and_never_raises(
    nodes: Any, stragglers: Any, round_: Any, offset: int, limit: int
) -> None:
    view = {"nodes": nodes, "stragglers": stragglers, "round": round_, "excluded": round_}
    answer = bounded(view, offset, limit)
    assert len(answer["nodes"]) <= limit and answer["offset"] == offset
    assert sum(answer["counts"]["state"].values()) == answer["total_nodes"]
    json.dumps(answer)  # what the API sends


async def test_the_api_pages_the_cluster_and_refuses_bad_paging(serve: ServeFactory) -> None:
    run = await serve("--nproc-per-node", "1", script_args=("--hang",))
    async with api_of(run) as api:
        code, answer, _ = await api.call("GET", "/v1/cluster")
        assert code == 200 and answer["total_nodes"] == 1, answer
        assert (answer["offset"], answer["limit"]) == (0, DEFAULT_LIMIT)
        assert answer["counts"]["role"] == {"active": 1}
        code, answer, _ = await api.call("GET", "/v1/cluster?offset=1&limit=1")
        assert code == 200 and answer["nodes"] == [] and answer["total_nodes"] == 1
        for query in ("limit=0", "limit=4097", "offset=-1", "offset=x", "limit=1&limit=2"):
            code, problem, response = await api.call("GET", f"/v1/cluster?{query}")
            assert code == 400, (query, problem)
            assert response.content_type == "application/problem+json", query
    await stop(run)


def test_ftd_status_says_how_many_more_nodes_there_are_and_where() -> None:
    page = bounded(cluster(300), 0, DEFAULT_LIMIT)
    lines = cluster_lines({}, page)
    assert lines[-2] == (
        f"... and {300 - DEFAULT_LIMIT} more nodes (all 300: restarting 4, running 296): "
        f"GET /v1/cluster?offset={DEFAULT_LIMIT}"
    ), lines
    assert lines[-1].startswith("stragglers: rank 2392 on node-00299 (1.5x")
    assert not more_nodes_lines(bounded(cluster(3), 0, DEFAULT_LIMIT), 3)
    assert not more_nodes_lines({"total_nodes": True}, 0)
    said = [line for line in lines if line.startswith("cluster: round")]
    assert said and "summaries read" not in said[0]  # a view read just now says nothing
    for age, shown in ((2.25, " (summaries read 2.2 s ago)"), (0.4, ""), (True, ""), ("9", "")):
        aged = {**page, "view_age_s": age}
        [said] = [line for line in cluster_lines({}, aged) if line.startswith("cluster: round")]
        assert said.endswith(f"excluded none{shown}"), said


def test_failed_nodes_are_listed_newest_first_and_no_reason_breaks_the_bound() -> None:
    view = cluster(NODES)
    for index, node in enumerate(view["nodes"]):
        if index % 5 == 0:  # a fifth of the job failed, each with a reason of 4,000 characters
            node["last_failure"] = f"rank {8 * index} exited 1: " + "x" * 4000
    answer = bounded(view, 0, DEFAULT_LIMIT)
    assert len(json.dumps(answer).encode()) <= 64 * 1024
    assert answer["total_failed"] == len(range(0, NODES, 5))
    times = [next(n["time"] for n in view["nodes"] if n["node_id"] == f["node_id"])
             for f in answer["failed"]]  # fmt: skip
    assert len(times) == WORST and times == sorted(times, reverse=True)
    assert all(len(f["last_failure"]) == 240 for f in answer["failed"])
    assert answer["nodes"][0]["last_failure"].startswith("rank 0 exited 1: xxx")
