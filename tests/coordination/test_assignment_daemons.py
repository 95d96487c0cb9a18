"""Real daemons where node rank 0 alone holds the round's list (`--rdzv-conf list_max=0`, as
every round of more than 64 nodes runs: ftd/coordination/assignment.py): the other node runs
its ranks from its assignment, restarts with the job, says its round's size, and answers an
operator's cluster view and exclusion from the list it reads when asked."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from tests.conftest import ROOT, Backend, ServeFactory, events_in
from tests.support.cluster import Cluster, api, ready_together, run_dir

pytestmark = pytest.mark.timeout(90)

LISTED_BY_RANK_0 = ("--rdzv-conf", "list_max=0")


async def test_a_node_without_the_list_restarts_with_the_job(
    serve: ServeFactory, backend: Backend
) -> None:
    cluster = Cluster(serve, "2", "--max-restarts", "1", *LISTED_BY_RANK_0, backend=backend)
    args = ("--hang-attempts", "1", "--fail-attempts", "1", "--fail-rank", "1")
    a = await cluster.first("a", *args)
    b = await cluster.node("b", *args)
    assert await a.wait() == 0 and await b.wait() == 0
    assert (a.out / "ready_a1_r0").exists() and (b.out / "ready_a1_r1").exists()
    assert "round 0 ended by b: rank 1 (local 0" in a.stderr.text
    held = [e["data"] for e in events_in(run_dir(b, "b"), "round_closed")]
    listed = [e["data"] for e in events_in(run_dir(a, "a"), "round_closed")]
    assert [(d["members"], d["size"], d["group_rank"]) for d in held] == [([], 2, 1)] * 2
    assert [(d["members"], d["size"], d["group_rank"]) for d in listed] == [(["a", "b"], 2, 0)] * 2
    assert "node rank 1 of 2 (node rank 0: a)" in b.stderr.text
    written = json.loads((run_dir(b, "b") / "cluster.json").read_text())
    assert (written["members"], written["size"]) == ([], 2)


async def test_a_node_without_the_list_answers_the_cluster_view_and_an_exclusion(
    serve: ServeFactory, backend: Backend
) -> None:
    cluster = Cluster(serve, "1:2", *LISTED_BY_RANK_0, backend=backend)
    a = await cluster.first("a", "--hang")
    b = await cluster.node("b", "--hang")
    n = await ready_together(a, b)
    code, view = await api(b, "b", "GET", "/v1/cluster")
    assert code == 200 and view["round"]["members"] == ["a", "b"], view  # type: ignore[index]
    code, problem = await api(b, "b", "POST", "/v1/nodes/nobody/exclude")
    assert code == 404 and "no node 'nobody' in the current round (a, b)" in str(problem), problem
    code, body = await api(b, "b", "POST", "/v1/nodes/b/exclude")  # (a hosts c10d's store)
    assert code == 202, body
    assert await b.wait(timeout=30) == 1
    assert "node b is excluded from job job" in b.stderr.text
    await a.stdout.expect(f"ready a{n + 1} r0")  # a goes on alone
    a.signal(signal.SIGTERM)
    assert await a.wait() == 128 + signal.SIGTERM


@pytest.mark.parametrize("value", ["abc", "-1", "100001", "9" * 50])
def test_a_bad_list_max_is_one_line_and_exit_2(value: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "ftd", "serve", "--nnodes", "2", "--rdzv-endpoint",
         "127.0.0.1:1", "--rdzv-conf", f"list_max={value}", "train.py"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"ftd serve: error: --rdzv-conf list_max={value[:40]}: a number of nodes, 0 to 100000"
    ]
